"""Every parallelism at once from one Topology, JAX side (issue 37, item 2).

``examples/llama_nnx.py``'s ``parallelize`` lays the Llama reference decoder out on 8 CPU
devices under the issue's configurations; each trains 4 steps of AdamW after
``gradsync_jax.clip_by_global_norm`` (a threshold the first steps exceed, so the clipping
binds) and must equal the unsharded model trained the same way on one device (its
``optax.clip_by_global_norm``): loss, parameters and both AdamW moments within the
reduction-order floor, 1e-5 relative to each tensor's largest entry (tests/jax/test_pipeline.py
states the floor that way; only the summation order differs). AdamW runs at lr 1e-3 with
eps 1e-6: at lr 1e-2 and eps 1e-8 Adam's normalisation amplifies the last bits of near-zero
gradients so much that the unsharded model differs from ITSELF by 1.0e-4 when its batch
gradient is summed as two halves (measured; 3.4e-6 at these settings), a floor above 1e-5.
The compositions not laid out are refused with one sentence before anything is placed.
Against ``examples/llama_torch.py``'s model (skipped until that file is merged in) the same
weights give the same logits, and torch's one-process training equals the compositions.
"""

from __future__ import annotations

import re
import tempfile
import time
from functools import cache
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import gradsync_jax
from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_nnx import Llama, parallelize, serial_loss
from gradsync_core import Topology
from gradsync_core.plan._llama import LlamaShape, llama_memory
from tests.support.asserts import assert_close

RTOL = 1e-5  # the reduction-order floor
STEPS, BATCH, SEQ = 4, 8, 16
LR, EPS, MAX_NORM = 1e-3, 1e-6, 0.5
DENSE = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
TIED = LlamaConfig(**{**DENSE.__dict__, "tie_embeddings": True})
MOE = LlamaConfig(**{**DENSE.__dict__, "n_experts": 4, "top_k": 2})


def _batches(cfg: LlamaConfig) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32) for _ in range(4)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def _params(cfg: LlamaConfig) -> tuple[Llama, Any]:
    model = Llama(cfg, rngs=nnx.Rngs(0))
    return model, nnx.to_pure_dict(nnx.state(model, nnx.Param))


@cache
def _reference(cfg: LlamaConfig) -> tuple[Any, Any, list[float]]:
    """The unsharded model, one device: ``STEPS`` steps of clipped AdamW on the whole batch."""
    model, params = _params(cfg)
    graphdef = nnx.graphdef(model)
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))

    @jax.jit
    def step(params: Any, state: Any, tokens: Any, targets: Any) -> Any:
        def loss_fn(p: Any) -> jax.Array:
            return serial_loss(nnx.merge(graphdef, p), tokens, targets)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss, optax.tree.norm(grads)

    state, losses, norms = tx.init(params), [], []
    for tokens, targets in _batches(cfg):
        params, state, loss, norm = step(params, state, tokens, targets)
        losses.append(float(loss))
        norms.append(float(norm))
    assert norms[0] > MAX_NORM, norms  # the clipping binds
    return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state), losses


SAVED = 2  # the step after which a composition of the tied or MoE model saves
_CHECKPOINTS: list[Path] = []  # the directory those checkpoints go to (set by a fixture)


@pytest.fixture(scope="module", autouse=True)
def _checkpoints(tmp_path_factory: pytest.TempPathFactory) -> None:
    if not _CHECKPOINTS:
        _CHECKPOINTS.append(tmp_path_factory.mktemp("nd-parallel-checkpoints"))


def _tx() -> optax.GradientTransformation:
    return optax.chain(gradsync_jax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))


@cache
def _train(cfg: LlamaConfig, topology: Topology, options: ParallelOptions) -> Any:
    """``STEPS`` steps of the composition (once per process: the torch comparison reads the
    same run); the tied and MoE models save after ``SAVED`` steps (``ParallelLlama.save``)
    for ``test_a_composition_checkpoint_continues_under_another_layout``.

    Returns:
        ``(params, state, losses, checkpoint path or None)``.
    """
    model, params = _params(cfg)
    par = parallelize(model, topology, options, tx=_tx(), seq_len=SEQ)
    stored = par.place(params)
    state = par.init(stored)
    losses, path = [], None
    for step, batch in enumerate(_batches(cfg)):
        stored, state, loss = par.step(stored, state, batch)
        losses.append(float(loss))
        if step + 1 == SAVED and cfg != DENSE:  # the dense layouts: test_nd_checkpoint.py
            path = Path(tempfile.mkdtemp(dir=_CHECKPOINTS[0])) / "checkpoint"
            par.save(path, stored, state, step=SAVED)
    return par.params_of(stored), par.state_of(state), losses, path


CONFIGS = [
    pytest.param(
        DENSE,
        dict(tp=2, dp_shard=2),
        ParallelOptions(),
        id="dp_replicate2-dp_shard2-tp2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        DENSE,
        dict(tp=2, dp_shard=4),
        ParallelOptions(sequence_parallel=False),
        id="dp_shard4-tp2-no-sp",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        TIED,
        dict(tp=2, cp=2),
        ParallelOptions(sequence_parallel=True),
        id="tp2-cp2-dp2-sp-tied",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        DENSE,
        dict(tp=2, pp=2, dp_shard=2),
        ParallelOptions(microbatches=4, schedule="1F1B"),
        id="dp_shard2-tp2-pp2",
        marks=pytest.mark.slow,
    ),
    pytest.param(
        MOE,
        dict(ep=2, pp=2, dp_shard=2),
        ParallelOptions(microbatches=2, schedule="1F1B"),
        id="ep2-dp_shard2-pp2-moe",
        marks=pytest.mark.slow,
    ),
]


@pytest.mark.parametrize(("cfg", "sizes", "options"), CONFIGS)
def test_composition_equals_the_unsharded_model(
    cfg: LlamaConfig, sizes: dict[str, Any], options: ParallelOptions
) -> None:
    topology = Topology.create(8, **sizes)
    start = time.perf_counter()
    params, state, losses, _ = _train(cfg, topology, options)
    seconds = time.perf_counter() - start
    ref_params, ref_state, ref_losses = _reference(cfg)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    worst_params = assert_close(params, ref_params, RTOL, "parameters")
    worst_state = assert_close(state, ref_state, RTOL, "optimizer state")
    sizes_text = ", ".join(
        f"{k}={v}" for k, v in {**topology.mesh_sizes(), "ep": topology.ep}.items() if v > 1
    )
    print(f"{sizes_text}: params {worst_params:.1e}, state {worst_state:.1e}, {seconds:.1f} s")


# (the composition that saved, the layout that loads): the cross-layout sweep's tied and MoE
# pairs (every ordered pair of the dense ones: tests/jax/test_nd_checkpoint.py, its tp x cp x
# dp with the dense model), each saved by the composition's own run above (no second
# compile): tp x cp with a tied embedding into HSDP x tp; ep x pp into ep without pp (and
# dp_replicate x dp_shard around it). The tied checkpoint under dp_shard x tp x pp is refused
# (test_the_tied_checkpoint_is_refused_under_the_pipeline).
CONTINUED = [
    pytest.param(CONFIGS[2], dict(tp=2, dp_shard=2), ParallelOptions(), id="tied-cp-to-hsdp-tp"),
    pytest.param(CONFIGS[4], dict(ep=2, dp_shard=2), ParallelOptions(), id="moe-ep-pp-to-ep-hsdp"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("saved", "sizes", "options"), CONTINUED)
def test_a_composition_checkpoint_continues_under_another_layout(
    saved: Any, sizes: dict[str, Any], options: ParallelOptions
) -> None:
    """Saved after 2 steps under one composition, loaded under another layout
    (``ParallelLlama.load``), 2 more steps: the losses, parameters and both moments equal
    the uninterrupted run on one device within the floor."""
    cfg, saved_sizes, saved_options = saved.values
    *_, path = _train(cfg, Topology.create(8, **saved_sizes), saved_options)
    model = Llama(cfg, rngs=nnx.Rngs(1))  # other weights: the load must replace them all
    par = parallelize(model, Topology.create(8, **sizes), options, tx=_tx(), seq_len=SEQ)
    stored, state, manifest = par.load(path)
    assert manifest.step == SAVED
    assert manifest.extra["layout"]["topology"] == Topology.create(8, **saved_sizes).to_json()
    losses = []
    for batch in _batches(cfg)[SAVED:]:
        stored, state, loss = par.step(stored, state, batch)
        losses.append(float(loss))
    ref_params, ref_state, ref_losses = _reference(cfg)
    np.testing.assert_allclose(losses, ref_losses[SAVED:], rtol=RTOL)
    worst_params = assert_close(par.params_of(stored), ref_params, RTOL, "parameters")
    worst_state = assert_close(par.state_of(state), ref_state, RTOL, "optimizer state")
    print(f"{sizes}: params {worst_params:.1e}, state {worst_state:.1e} after the load")


@pytest.mark.slow
def test_the_tied_checkpoint_is_refused_under_the_pipeline() -> None:
    """tp x cp x dp's tied checkpoint has no output layer for dp_shard x tp x pp: the tied
    model under pp is refused ("tied-pp" below), and the untied one refuses the checkpoint
    with one sentence before anything is placed (that pair is tested with the dense model
    under tp x cp x dp in tests/jax/test_nd_checkpoint.py)."""
    cfg, saved_sizes, saved_options = CONFIGS[2].values
    *_, path = _train(cfg, Topology.create(8, **saved_sizes), saved_options)
    _, sizes, options = CONFIGS[3].values
    model = Llama(DENSE, rngs=nnx.Rngs(1))
    par = parallelize(model, Topology.create(8, **sizes), options, tx=_tx(), seq_len=SEQ)
    with pytest.raises(ValueError, match=re.escape("lacks 'output.weight'")) as refused:
        par.load(path)
    assert "\n" not in str(refused.value)
    print(f"refused: {refused.value}")


@pytest.mark.parametrize(
    "sizes", [dict(tp=2, dp_shard=2), dict(tp=2, dp_shard=4), dict(tp=2, dp_shard=1)]
)
def test_each_device_holds_the_bytes_gradsync_plan_predicts(sizes: dict[str, Any]) -> None:
    """Parameters and AdamW state placed by ``parallelize``: per device, the composed
    prediction's parameters + state (``llama_memory``, what ``gradsync plan --zero 3``
    prints), plus optax's scalar step counts, which the prediction leaves out; the output
    layer is cut over tp as torch's reference and the prediction cut it."""
    topology = Topology.create(8, **sizes)
    model, params = _params(DENSE)
    tx = optax.chain(gradsync_jax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))
    par = parallelize(model, topology, tx=tx, seq_len=SEQ)
    stored = par.place(params)
    state = par.init(stored)
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves([stored, state]):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    counts = sum(leaf.nbytes for leaf in jax.tree.leaves(state) if leaf.ndim == 0)
    shape = LlamaShape(**{f: getattr(DENSE, f) for f in LlamaShape.__dataclass_fields__})
    (row,) = llama_memory(shape, topology, optimizer="adamw")
    predicted = row.memory.parameter_bytes + row.memory.optimizer_state_bytes
    assert set(held.values()) == {predicted + counts}


REFUSALS = [
    pytest.param(TIED, dict(pp=2), "tie_embeddings with pp > 1", id="tied-pp"),
    pytest.param(MOE, dict(ep=2, tp=2), "no expert tensor parallelism", id="ep-tp"),
    pytest.param(
        MOE, dict(ep=2, dp_shard=4), "make dp_shard (or dp_replicate)", id="ep-in-dp_shard"
    ),
    pytest.param(DENSE, dict(tp=4), "n_kv_heads 2 is not divisible by tp=4", id="kv-heads"),
    pytest.param(DENSE, dict(ep=2), "ep=2 needs the MoE variant", id="ep-dense"),
]


@pytest.mark.parametrize(("cfg", "sizes", "message"), REFUSALS)
def test_refuses_what_it_does_not_lay_out(
    cfg: LlamaConfig, sizes: dict[str, Any], message: str
) -> None:
    model, _ = _params(cfg)
    tx = optax.chain(gradsync_jax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))
    with pytest.raises(ValueError, match=re.escape(message)):
        parallelize(model, Topology.create(8, **sizes), tx=tx, seq_len=SEQ)


def test_refuses_optax_clipping_on_chunks() -> None:
    """``optax.clip_by_global_norm`` would clip each device's chunks by their own norm."""
    model, _ = _params(DENSE)
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))
    with pytest.raises(ValueError, match="exact only for an elementwise update"):
        parallelize(model, Topology.create(8, tp=2), tx=tx, seq_len=SEQ)


@pytest.mark.slow
def test_the_example_trains_beside_one_device(capsys: pytest.CaptureFixture[str]) -> None:
    """``examples/llama_nd_jax.py`` with the MoE flags: its printed loss is the one device's."""
    from examples.llama_nd_jax import main

    flags = "--ep 2 --dp-shard 2 --dp-replicate 2 --pp 2 --experts 4 --steps 2"
    summary = main(flags.split())
    assert "pipeline: 1F1B, 2 microbatches, 2 stages" in capsys.readouterr().out
    assert summary["final_loss"] == pytest.approx(summary["one_device_final_loss"], rel=RTOL)
    assert summary["max_relative_param_difference"] <= RTOL


def _torchtitan_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """torchtitan's Llama 3 names and torch layouts (``Linear.weight`` is ``(out, in)``)."""
    hd, ffn = cfg.head_dim, cfg.ffn_dim
    shapes = {"tok_embeddings.weight": (cfg.vocab_size, cfg.dim), "norm.weight": (cfg.dim,)}
    if not cfg.tie_embeddings:
        shapes["output.weight"] = (cfg.vocab_size, cfg.dim)
    for i in range(cfg.n_layers):
        layer = f"layers.{i}"
        shapes |= {
            f"{layer}.attention_norm.weight": (cfg.dim,),
            f"{layer}.attention.wq.weight": (cfg.n_heads * hd, cfg.dim),
            f"{layer}.attention.wk.weight": (cfg.n_kv_heads * hd, cfg.dim),
            f"{layer}.attention.wv.weight": (cfg.n_kv_heads * hd, cfg.dim),
            f"{layer}.attention.wo.weight": (cfg.dim, cfg.n_heads * hd),
            f"{layer}.ffn_norm.weight": (cfg.dim,),
        }
        mlp = f"{layer}.feed_forward"
        if cfg.n_experts:
            e = cfg.n_experts
            shapes |= {
                f"{mlp}.router.weight": (e, cfg.dim),
                f"{mlp}.experts.w1": (e, ffn, cfg.dim),
                f"{mlp}.experts.w2": (e, cfg.dim, ffn),
                f"{mlp}.experts.w3": (e, ffn, cfg.dim),
            }
        else:
            shapes |= {
                f"{mlp}.w1.weight": (ffn, cfg.dim),
                f"{mlp}.w2.weight": (cfg.dim, ffn),
                f"{mlp}.w3.weight": (ffn, cfg.dim),
            }
    return shapes


@pytest.mark.parametrize("cfg", [DENSE, TIED, MOE], ids=["dense", "tied", "moe"])
def test_naming_rules_give_torchtitans_names_and_layouts(cfg: LlamaConfig) -> None:
    """``gradsync_jax.to_torch_state`` maps the NNX tree onto torchtitan's names and shapes."""
    state = gradsync_jax.to_torch_state(_params(cfg)[1])
    assert {k: v.shape for k, v in state.items()} == _torchtitan_shapes(cfg)


def _torch_llama(cfg: LlamaConfig, params: Any) -> Any:
    """``examples/llama_torch.py``'s model holding the NNX model's weights (naming rules)."""
    torch = pytest.importorskip("torch")
    llama_torch = pytest.importorskip(
        "examples.llama_torch", reason="examples/llama_torch.py arrives with the torch branch"
    )
    model = llama_torch.Llama(cfg)
    state = {k: torch.from_numpy(v) for k, v in gradsync_jax.to_torch_state(params).items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"output.weight"} if cfg.tie_embeddings else set())
    return model


@pytest.mark.parametrize("cfg", [DENSE, TIED, MOE], ids=["dense", "tied", "moe"])
def test_the_torch_twin_computes_the_same_logits(cfg: LlamaConfig) -> None:
    """The torch model of ``examples/llama_torch.py`` on the NNX weights: the same logits."""
    model, params = _params(cfg)
    torch_model = _torch_llama(cfg, params)
    import torch

    tokens = _batches(cfg)[0][0]
    with torch.no_grad():
        expected = torch_model(torch.from_numpy(tokens).long()).numpy()
    np.testing.assert_allclose(
        np.asarray(model(jnp.asarray(tokens))), expected, rtol=RTOL, atol=RTOL
    )


@pytest.mark.slow
@pytest.mark.parametrize(("cfg", "sizes", "options"), [CONFIGS[0], CONFIGS[4]])
def test_the_composition_equals_the_torch_model_trained_on_one_process(
    cfg: LlamaConfig, sizes: dict[str, Any], options: ParallelOptions
) -> None:
    """The JAX composition against torch's unsharded twin, 4 steps of ``clip_grad_norm_`` and
    ``torch.optim.AdamW`` with optax's defaults: parameters and both moments in torch's names
    and layouts, within the floor."""
    import torch

    _, params = _params(cfg)
    torch_model = _torch_llama(cfg, params)
    opt = torch.optim.AdamW(torch_model.parameters(), lr=LR, eps=EPS, weight_decay=1e-4)
    for tokens, targets in _batches(cfg):
        opt.zero_grad()
        logits = torch_model(torch.from_numpy(tokens).long())
        loss = torch.nn.functional.cross_entropy(
            logits.flatten(0, 1), torch.from_numpy(targets).long().flatten()
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(torch_model.parameters(), MAX_NORM)
        opt.step()
    jax_params, jax_state, *_ = _train(cfg, Topology.create(8, **sizes), options)
    adam = jax_state[1][0]  # chain(clip, adamw): adamw's chain, its scale_by_adam state
    names = dict(torch_model.named_parameters())
    for what, jax_tree, torch_of in [
        ("parameters", jax_params, lambda p: p),
        ("first moments", adam.mu, lambda p: opt.state[p]["exp_avg"]),
        ("second moments", adam.nu, lambda p: opt.state[p]["exp_avg_sq"]),
    ]:
        ours = gradsync_jax.to_torch_state(jax_tree)
        theirs = {k: torch_of(names[k]).detach().numpy() for k in ours}
        worst = assert_close(ours, theirs, RTOL, f"{what} (torch)")
        print(f"{sizes}: {what} {worst:.1e} from torch's")
