"""A checkpoint that crosses layouts (issue 37 item 3): saved under one composition of the
Llama reference, loaded under another, in one process, and inspected.

One spawn of 8 gloo ranks trains each saved layout of ``nd_checkpoint_checks.PAIRS`` 2 steps
and saves it once (``save_boxes``), then runs every pair (``load_boxes`` under the other
layout, train 2 more; parameters, AdamW moments and the two losses after the load against 4
uninterrupted steps in one process, float64), the refusals, and
the load under a torch layout of a checkpoint gradsync_jax saved (written here, first).
The checkpoints it leaves are then loaded here, in one process, by the loaders that existed
before (``load_model_weights``, ``load_optimizer_state_dict``: no code of their own for this
format), continued, and compared the same way; JAX continues two of them with its own
loaders; and ``gradsync checkpoint inspect`` prints the layout each was saved under.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync_core import Topology
from gradsync_core.checkpoint import describe_layout
from tests.support.harness import SKIPPED, run_checks, run_workers
from tests.torch import nd_checkpoint_checks as checks
from tests.torch.nd_checks import RTOL

PAIRS = [checks.pair_name(s, lo) for s, lo in checks.PAIRS]
SAVED = checks.SAVES


def run_all(rank: int, ws: int, directory: str) -> dict[str, str | None]:
    named = [
        (f"save {s}", functools.partial(checks.save_layout, rank, ws, s, directory))
        for s in checks.SAVES
    ]
    named += [
        (checks.pair_name(s, lo), functools.partial(checks.check_pair, rank, ws, s, lo, directory))
        for s, lo in checks.PAIRS
    ]
    named.append(("refusals", functools.partial(checks.check_refusals, rank, ws, directory)))
    named.append(("jax", functools.partial(checks.check_jax_checkpoint, rank, ws, directory)))
    return run_checks(named, keep_going=True)


_results: list[dict[str, str | None]] = []


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory the spawn saved its checkpoints in (one per saved layout)."""
    directory = tmp_path_factory.mktemp("nd-checkpoint")
    if not _results:
        try:
            import jax  # noqa: F401
        except ImportError:
            pass  # the JAX check then reports itself skipped
        else:
            checks.save_in_jax(str(directory / checks.JAX_SAVED))
        _results.extend(run_workers(run_all, 8, str(directory), timeout=600))
    return directory


def _assert_passed(check: str) -> None:
    for rank, outcome in enumerate(_results):
        assert check in outcome, f"check {check} did not run on rank {rank}"
    errors = [(rank, o[check]) for rank, o in enumerate(_results) if o[check] is not None]
    errors.sort(key=lambda e: str(e[1]).startswith("passed here"))
    assert not errors, f"rank {errors[0][0]} of 8: {errors[0][1]}"


@pytest.mark.slow
@pytest.mark.parametrize("pair", PAIRS)
def test_a_checkpoint_loads_under_another_layout(pair: str, saved: Path) -> None:
    _assert_passed(f"save {pair.split('->')[0]}")
    _assert_passed(pair)
    worst = json.loads((saved / f"{pair}.json").read_text())
    print(f"{pair}: max abs difference from an uninterrupted run {worst}")


@pytest.mark.slow
def test_loads_that_cannot_be_expressed_refuse_before_changing_anything(saved: Path) -> None:
    _assert_passed("refusals")


@pytest.mark.slow
def test_a_jax_checkpoint_loads_under_a_torch_layout(saved: Path) -> None:
    outcome = _results[0]["jax"]
    if outcome is not None and outcome.startswith(SKIPPED):
        pytest.skip(outcome)
    _assert_passed("jax")


@pytest.mark.slow
@pytest.mark.parametrize("name", SAVED)
def test_one_process_continues_from_any_layout(name: str, saved: Path) -> None:
    """The plain torch loaders read the checkpoint into the serial model, which then
    continues as if never interrupted."""
    from examples.llama_torch import Llama, lm_loss_share
    from gradsync_torch.checkpoint import load_model_weights, load_optimizer_state_dict

    config = checks.LAYOUTS[name][0]
    model = Llama(config, seed=7).double()  # other weights: the load must replace them all
    opt = checks._adamw(model.parameters())
    manifest = load_model_weights(saved / name, model)
    load_optimizer_state_dict(saved / name, opt, model)
    assert manifest.step == checks.SAVED
    for tokens, targets in checks.batches()[checks.SAVED :]:
        lm_loss_share(model(tokens), targets, tokens.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), checks.MAX_NORM)
        opt.step()
        opt.zero_grad()
    ref, ref_opt = checks.reference(config)
    mine = dict(model.named_parameters())
    for pname, want in ref.named_parameters():
        got = mine[pname]
        pairs = [("param", got.detach(), want.detach())]
        pairs += [(k, opt.state[got][k], ref_opt.state[want][k]) for k in ("exp_avg", "exp_avg_sq")]
        for kind, actual, expected in pairs:
            scale = float(expected.abs().max())
            assert torch.allclose(actual, expected, rtol=RTOL, atol=RTOL * scale), (
                f"{name}: {kind} of {pname}: {float((actual - expected).abs().max()):.3e}"
            )


@pytest.mark.slow
@pytest.mark.parametrize("name", ["dp_shard2_tp2_pp2", "tp2_cp2_dp2_sp"])
def test_inspect_prints_the_layout_it_was_saved_under(name: str, saved: Path) -> None:
    config, sizes, _ = checks.LAYOUTS[name]
    out = subprocess.run(
        [sys.executable, "-m", "gradsync_core", "checkpoint", "inspect", str(saved / name)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    topology = Topology.create(8, **sizes)
    expected = {
        "dp_shard2_tp2_pp2": "torch, dp 2 x tp 2 x pp 2 (8 ranks), pipeline 1F1B with 2 "
        "microbatches",
        "tp2_cp2_dp2_sp": "torch, dp 2 x cp 2 x tp 2 (8 ranks)",
    }[name]
    assert f"saved under: {expected}" in out.stdout
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync_core",
            "checkpoint",
            "inspect",
            "--json",
            str(saved / name),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    layout = json.loads(out.stdout)["layout"]
    assert layout["topology"] == topology.to_json()
    assert layout["model"] == config.__dict__
    assert describe_layout(layout) == expected


JAX_RTOL = 1e-5  # the JAX compositions' floor (tests/jax/test_nd_parallel.py): its loss is float32


# every composition of issue 37 item 2 (the three dense ones and the MoE one)
ITEM_2 = [
    "dp_replicate2_dp_shard2_tp2",
    "tp2_cp2_dp2_sp",
    "dp_shard2_tp2_pp2",
    "ep2_dp_shard2_pp2_moe",
]


@pytest.mark.slow
@pytest.mark.parametrize("name", ITEM_2)
def test_jax_continues_from_a_torch_layout(name: str, saved: Path) -> None:
    """gradsync_jax's loaders (``load_params``, ``load_optimizer_state``: no code of their own
    for this format) read the checkpoint into the Flax NNX twin and plain Optax; 2 more steps
    in JAX equal the uninterrupted torch run within the JAX floor (parameters and moments)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    import gradsync_jax
    from examples.llama_nnx import Llama, serial_loss
    from gradsync_jax.checkpoint import load_optimizer_state, load_params
    from tests.support.asserts import assert_close

    config = checks.LAYOUTS[name][0]
    with jax.enable_x64(True):  # the checkpoint is float64 (never cast by the loaders)
        model = Llama(config, rngs=nnx.Rngs(3))
        graphdef = nnx.graphdef(model)
        like = jax.tree.map(
            lambda x: x.astype(jnp.float64), nnx.to_pure_dict(nnx.state(model, nnx.Param))
        )
        params = load_params(saved / name, like)
        tx = optax.chain(
            optax.clip_by_global_norm(checks.MAX_NORM),
            optax.adamw(checks.LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1),
        )
        state, manifest = load_optimizer_state(saved / name, tx, params)
        assert manifest.step == checks.SAVED

        @jax.jit
        def step(params: object, state: object, tokens: object, targets: object) -> object:
            def loss_fn(p: object) -> object:
                return serial_loss(nnx.merge(graphdef, p), tokens, targets)

            grads = jax.grad(loss_fn)(params)
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state

        for tokens, targets in checks.batches()[checks.SAVED :]:
            params, state = step(params, state, jnp.asarray(tokens), jnp.asarray(targets))
        adam = state[1][0]
        got = {
            kind: gradsync_jax.to_torch_state(jax.tree.map(np.asarray, tree))
            for kind, tree in (("params", params), ("exp_avg", adam.mu), ("exp_avg_sq", adam.nu))
        }
    ref, ref_opt = checks.reference(config)
    named = dict(ref.named_parameters())
    want = {"params": {n: p.detach().numpy() for n, p in named.items()}}
    for kind in ("exp_avg", "exp_avg_sq"):
        want[kind] = {n: ref_opt.state[p][kind].numpy() for n, p in named.items()}
    for kind in want:
        worst = assert_close(got[kind], want[kind], JAX_RTOL, f"{name}: {kind}")
        print(f"{name}: {kind} max relative difference {worst:.2e}")


def test_a_plain_optimizer_over_experts_and_dense_parameters_round_trips(tmp_path: Path) -> None:
    """One process, one AdamW over the MoE model (experts beside dense weights, as a model
    loaded from a cross-layout checkpoint is trained): the plain save and load take it; only
    optimizers that plan owners over a group (ZeRO) must keep experts apart."""
    from examples.llama_torch import Llama, lm_loss_share
    from gradsync_torch.checkpoint import load_optimizer_state_dict
    from gradsync_torch.checkpoint.plain_save import save_plain

    model = Llama(checks.MOE, seed=1).double()
    opt = checks._adamw(model.parameters())
    tokens, targets = checks.batches()[0]
    lm_loss_share(model(tokens), targets, tokens.numel()).backward()
    opt.step()
    save_plain(tmp_path / "ckpt", model, opt)
    again = checks._adamw(model.parameters())
    load_optimizer_state_dict(tmp_path / "ckpt", again, model)
    for param in model.parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(again.state[param][key], opt.state[param][key])
