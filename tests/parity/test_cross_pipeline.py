"""One pipeline plan, two executors: torch's and JAX's train the same model alike (issue 36 item 3).

The GPT of ``examples/pipeline_models.py`` (torch, ``gpt_blocks``) and its twin in Flax NNX
(``examples/pipeline_models_nnx.py``, the blocks stacked under ``nnx.vmap``), the NNX weights
copied from torch's through the sequential layout (``sequential_params``: the one mapping of
the stacked blocks to torch's per-layer names). The plan is made once, here; the torch ranks
read its JSON and run it with ``gradsync_torch.Pipeline`` (gloo, one rank per pipeline rank),
this process runs it with ``gradsync_jax.pipeline_step`` on as many CPU devices. Both train
``STEPS`` steps of AdamW, float32, and must agree in the loss of every step, the first
step's gradients, and the parameters and both moments at the end; then a checkpoint saved by
one executor continues in the other, at another pp, as the saver's run continues.

Why these tolerances (relative to each tensor's largest magnitude; the loss to itself). The
two frameworks' kernels round otherwise (XLA fuses a stage's program, torch runs op by op), so
the floor is this model's reduction-order floor, which one framework alone already shows:
after 3 AdamW steps (4 blocks, ZB1P at pp 2) the JAX pipeline's parameters differ from the
unpipelined JAX program's (each microbatch in turn, the same order) by 5.8e-6, and the
unpipelined JAX program's from the unpipelined torch model's by 1.4e-5; the two pipelines
differ by 8.4e-8 in the losses, 5.1e-7 in the first step's gradients, 1.6e-5 in the
parameters and 6.3e-6 in the moments (at pp 4: 7.8e-7 in the gradients). Every schedule
gives these same numbers: each executor adds the microbatches in microbatch order under
every schedule (docs/design.md §17), so a schedule changes no bits on either side. The
tolerances are about 4x the largest measured; a wrong name, layout, layer order, microbatch
split or optimizer step errs by 1e-3 or more (the blocks in reverse order: 1.7e-3 in the
first loss). Adam amplifies the rounding of elements whose gradient is small (its update
``m / (sqrt(v) + eps)`` is scale-free), and ``eps = 1e-5`` (LLaMA's) instead of 1e-8 keeps it
from amplifying pure noise: attention's key bias has a zero gradient mathematically (the
softmax is shift-invariant) and a float32 one of ~2e-10, which eps 1e-8 turns into steps of
~lr/50 that differ between the frameworks (3e-3 in those biases after 3 steps). Betas (0.5,
0.75) as in test_cross_checkpoint.py: float32 holds their powers exactly, so Optax's float32
bias correction is torch's float64 one.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import nnx

from examples.pipeline_models import gpt_blocks, token_batch
from examples.pipeline_models_nnx import GPT, lm_loss
from gradsync_core import SCHEDULES, PipelinePlan, Topology, plan_pipeline
from gradsync_jax import (
    from_torch_state,
    load_pipeline,
    mesh_from_topology,
    natural_params,
    nnx_model,
    pipeline_params,
    pipeline_step,
    save_pipeline,
    sequential_params,
    stacked_params,
    to_torch_state,
)
from tests.parity import pipeline_worker
from tests.support.harness import run_workers
from tests.support.xla import FAST_COMPILE

LAYERS, ROWS, STEPS = 4, 8, 3  # ROWS: sequences per step, in 2 pp microbatches
SEQ, VOCAB = 8, 32
PP4 = ("DualPipeV",)  # the pp 4 case: 8 blocks, one per stage, in a V over 4 ranks
RTOL = {"loss": 4e-7, "grads": 3e-6, "params": 6e-5, "state": 3e-5}
TX = optax.adamw(1e-2, b1=0.5, b2=0.75, eps=1e-5, weight_decay=0.1)  # pipeline_worker.HYPER
MOMENTS = {"exp_avg": "mu", "exp_avg_sq": "nu"}


def plan_of(
    schedule: str, pp: int, layers: int = LAYERS, microbatches: int | None = None
) -> PipelinePlan:
    """Every stage the same number of blocks (the JAX executor's one program), one stage per
    rank for GPipe and 1F1B, two for the others; 2 pp microbatches (DualPipeV's least) unless
    given."""
    return plan_pipeline(
        schedule=schedule,
        microbatches=2 * pp if microbatches is None else microbatches,
        topology=Topology.create(pp, pp=pp),
        layers=layers,
        stages_per_rank=1 if schedule in ("GPipe", "1F1B") else 2,
        input_weight=0,
        output_weight=0,
    )


def batches(steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    return [tuple(t.numpy() for t in token_batch(ROWS, SEQ, VOCAB, 100 + s)) for s in range(steps)]


class Twins:
    """The torch GPT's weights (torch names) and the NNX twin's pipeline model and natural
    parameters holding the same numbers."""

    def __init__(self, layers: int) -> None:
        self.layers = layers
        torch_model = gpt_blocks(layers=layers, seq=SEQ, vocab=VOCAB)
        self.torch_init = {
            k: v.detach().numpy().copy() for k, v in torch_model.state_dict().items()
        }
        gpt = GPT(layers=layers, seq=SEQ, vocab=VOCAB, rngs=nnx.Rngs(0))
        self.model, natural, _ = nnx_model(gpt.embed, gpt.blocks, gpt.head, lm_loss)
        self.natural = stacked_params(from_torch_state(self.torch_init, sequential_params(natural)))


_twins: dict[int, Twins] = {}


def twins(layers: int = LAYERS) -> Twins:
    if layers not in _twins:
        _twins[layers] = Twins(layers)
    return _twins[layers]


def torch_names(tree: Any) -> dict[str, np.ndarray]:
    """Natural-layout values (parameters or a moment) by torch name."""
    return to_torch_state(sequential_params(tree))


_compiled: dict[tuple[str, int], Any] = {}


def train_jax(
    plan: PipelinePlan,
    data: list[tuple[np.ndarray, np.ndarray]],
    *,
    layers: int = LAYERS,
    load_from: str | None = None,
    save_at: int | None = None,
    save_to: str | None = None,
) -> dict[str, Any]:
    """The plan on ``plan.pp`` CPU devices, one step per batch, as ``pipeline_worker.train``
    runs it in torch; the same record, by torch name (the first step's gradients only when
    it starts from the initial weights), and the manifest loaded."""
    net = twins(layers)
    mesh = mesh_from_topology(plan.topology, jax.devices()[: plan.topology.world_size])
    step = pipeline_step(net.model, TX, mesh, plan)
    manifest = None
    if load_from is None:
        params = pipeline_params(net.natural, plan, mesh)
        state = step.init(params)
    else:
        params, state, manifest = load_pipeline(load_from, step, net.natural)
    data = [(x.astype(np.int32), y.astype(np.int32)) for x, y in data]
    key = (plan.fingerprint, layers)
    if key not in _compiled:  # the same program for every run of the plan
        _compiled[key] = step.lower(params, state, data[0]).compile(compiler_options=FAST_COMPILE)
    losses, grads = [], {}
    for i, batch in enumerate(data):
        params, state, loss = _compiled[key](params, state, batch)
        losses.append(float(loss))
        if i == 0 and load_from is None:  # b1 = 0.5: the first mu is half the gradient
            mu = step.natural_state(state, params)[0].mu
            grads = torch_names(jax.tree.map(lambda g: 2 * g, mu))
        if i + 1 == save_at:
            assert save_to is not None
            save_pipeline(save_to, step, params, state, step=save_at)
    adam = step.natural_state(state, params)[0]
    return {
        "losses": losses,
        **({"grads": grads} if grads else {}),
        "params": torch_names(natural_params(params, plan)),
        "state": {
            f"{name}/{key}": value
            for key, field in MOMENTS.items()
            for name, value in torch_names(getattr(adam, field)).items()
        },
        "count": int(adam.count),
        "manifest": manifest,
    }


def train_torch(plans: list[PipelinePlan], data: Any, layers: int = LAYERS, *args: Any) -> list:
    """``pipeline_worker.train`` on ``pp`` gloo ranks; each plan's record merged over ranks
    (the losses: each step's mean over the microbatches, from the last stage's rank)."""
    (pp,) = {plan.pp for plan in plans}
    init = twins(layers).torch_init
    ranks = run_workers(
        pipeline_worker.train, pp, [p.to_json() for p in plans], init, data, layers, *args
    )
    out = []
    for i in range(len(plans)):
        merged: dict[str, Any] = {"grads": {}, "params": {}, "state": {}, "steps": {}}
        if not any(rank[i]["grads"] for rank in ranks):
            del merged["grads"]
        for rank in ranks:
            record = rank[i]
            for key in ("grads", "params", "state", "steps"):
                if key in merged:
                    merged[key].update(record[key])
            if record["losses"] is not None:
                merged["losses"] = [float(np.mean(np.float64(step))) for step in record["losses"]]
        out.append(merged)
    return out


def differences(got: dict[str, Any], want: dict[str, Any], what: str) -> dict[str, float]:
    """The largest relative difference of each kind, each held to ``RTOL``."""
    worst = {}
    if "losses" in want and "losses" in got:
        worst["loss"] = max(
            abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True)
        )
    for kind in ("grads", "params", "state"):
        if kind not in got or kind not in want:
            continue
        assert sorted(got[kind]) == sorted(want[kind]), f"{what}: {kind} names differ"
        worst[kind] = 0.0
        for name, value in want[kind].items():
            scale = float(np.abs(value).max()) or 1.0
            worst[kind] = max(worst[kind], float(np.abs(got[kind][name] - value).max()) / scale)
    for kind, error in worst.items():
        assert error <= RTOL[kind], f"{what}: {kind} differ by {error:.2e} relative"
    print(what, {kind: f"{error:.1e}" for kind, error in worst.items()})
    return worst


_torch_runs: dict[int, dict[str, dict[str, Any]]] = {}


def torch_run(schedule: str, pp: int) -> dict[str, Any]:
    """torch's run of ``plan_of(schedule, pp)``: every schedule of that pp in one spawn, the
    first time one is asked for (the torch side costs about a second per schedule)."""
    if pp not in _torch_runs:
        names = list(SCHEDULES) if pp == 2 else list(PP4)
        layers = LAYERS if pp == 2 else 2 * pp
        runs = train_torch([plan_of(n, pp, layers) for n in names], batches(STEPS), layers)
        _torch_runs[pp] = dict(zip(names, runs, strict=True))
    return _torch_runs[pp][schedule]


def run_both(schedule: str, pp: int) -> None:
    layers = LAYERS if pp == 2 else 2 * pp
    theirs = torch_run(schedule, pp)
    mine = train_jax(plan_of(schedule, pp, layers), batches(STEPS), layers=layers)
    assert mine["count"] == STEPS and set(theirs["steps"].values()) == {float(STEPS)}
    moved = max(
        float(np.abs(theirs["params"][k] - v).max()) for k, v in twins(layers).torch_init.items()
    )
    assert moved > 1e-2  # it trained: a run that moves nothing would pass trivially
    differences(mine, theirs, f"{schedule} pp {pp}: JAX vs torch")


@pytest.mark.slow
def test_zero_bubble_same_in_torch_and_jax() -> None:
    """ZB1P at pp 2 (two stages per rank, the backward split): the fast representative."""
    run_both("InterleavedZeroBubble", 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", [s for s in SCHEDULES if s != "InterleavedZeroBubble"])
def test_schedule_same_in_torch_and_jax(schedule: str) -> None:
    run_both(schedule, 2)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", PP4)
def test_pp4_same_in_torch_and_jax(schedule: str) -> None:
    """pp 4 on 4 gloo ranks and 4 devices."""
    run_both(schedule, 4)


# -- a checkpoint crosses over -----------------------------------------------------------------
# torch trains ZB1P at pp 2 (two stages per rank), JAX 1F1B at pp 4; 4 microbatches each, so
# both sum the same microbatches. 4 steps: a save after 2, then 2 more in the other executor.


def continued(first: dict[str, Any]) -> dict[str, Any]:
    """The uninterrupted run's record with the losses of the steps after the save only."""
    return {**{k: v for k, v in first.items() if k != "grads"}, "losses": first["losses"][2:]}


@pytest.mark.slow
def test_torch_pipeline_checkpoint_continues_in_jax(tmp_path) -> None:
    """A pp 2 torch pipeline saves after 2 steps (``gradsync_torch.save_pipeline``) and goes
    on to 4; a pp 4 JAX pipeline loads the save (``load_pipeline``) and trains steps 3 and 4:
    the same losses, parameters and AdamW moments."""
    data, path = batches(4), str(tmp_path / "torch")
    (theirs,) = train_torch(
        [plan_of("InterleavedZeroBubble", 2, microbatches=4)], data, LAYERS, 2, path
    )
    mine = train_jax(plan_of("1F1B", 4, microbatches=4), data[2:], load_from=path)
    manifest = mine["manifest"]
    assert (manifest.framework, manifest.step, manifest.world_size) == ("torch", 2, 1)
    assert mine["count"] == 4 and set(theirs["steps"].values()) == {4.0}
    differences(mine, continued(theirs), "torch pp 2 -> JAX pp 4, vs torch")


@pytest.mark.slow
def test_jax_pipeline_checkpoint_continues_in_torch(tmp_path) -> None:
    """The other way: a pp 4 JAX pipeline saves after 2 steps (``save_pipeline``) and goes on
    to 4; a pp 2 torch pipeline loads the save (``gradsync_torch.load_pipeline``) and trains
    steps 3 and 4."""
    data, path = batches(4), str(tmp_path / "jax")
    mine = train_jax(plan_of("1F1B", 4, microbatches=4), data, save_at=2, save_to=path)
    (theirs,) = train_torch(
        [plan_of("InterleavedZeroBubble", 2, microbatches=4)], data[2:], LAYERS, None, None, path
    )
    assert mine["count"] == 4 and set(theirs["steps"].values()) == {4.0}
    differences(theirs, continued(mine), "JAX pp 4 -> torch pp 2, vs JAX")
