"""One semantics for both frameworks: the same MLP, weights and data give the same training.

torch: ``gradsync_torch.DataParallel`` over 2 gloo ranks. JAX: ``gradsync_jax`` over 2 CPU
devices. Both start from the Flax initialization (mapped by ``gradsync_jax.to_torch_state``), train
10 steps with SGD and with Adam, and must end with the same parameters and Adam moments:
relative error ``max|a - b| / max|b| <= 1e-5`` per tensor (the two frameworks' float32
kernels round differently). The bucket plans built from the torch module and from the Flax
tree must have the same fingerprint.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gradsync_core import (
    DEFAULT_FIRST_CAP_BYTES,
    ShardPlan,
    Topology,
    describe_difference,
    plan_buckets,
)
from gradsync_jax import (
    data_parallel_step,
    from_torch_state,
    mesh_from_topology,
    shard_optimizer,
    to_torch_state,
    torch_names,
    torch_plan,
    torch_specs,
)
from gradsync_jax import param_specs as flax_param_specs
from gradsync_jax._naming import torch_name
from gradsync_torch import param_specs as torch_param_specs
from tests.parity.torch_worker import RENAMES, WIDTHS, TorchMLP, train
from tests.support.harness import one_rank_group, run_workers
from tests.support.models import LinenMLP, NnxMLP

STEPS = 10
# Betas whose powers float32 holds exactly: optax computes Adam's bias corrections
# 1 - b**t and its 1 - b in float32, torch in float64. With the usual (0.9, 0.999), float32's
# 0.999 makes 1 - b2 wrong by 1.3e-5 relative, and a single-device optax run already differs
# from torch (and from a float64 run) by ~1e-5 after 10 steps, with no gradsync involved.
OPTIMIZERS = {"sgd": {"lr": 0.05}, "adam": {"lr": 1e-3, "betas": (0.5, 0.75), "eps": 1e-8}}
RTOL = 1e-5


def _plans(specs) -> list:
    return [
        plan_buckets(specs, first_cap_bytes=DEFAULT_FIRST_CAP_BYTES),  # DDP's (and DataParallel's)
        plan_buckets(specs, cap_bytes=2048, first_cap_bytes=1024),  # several buckets
    ]


def test_flax_and_torch_plans_have_the_same_fingerprint() -> None:
    torch_specs_ = torch_param_specs(TorchMLP(WIDTHS))
    linen = LinenMLP(WIDTHS).init(jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
    nnx_params = nnx.state(NnxMLP(WIDTHS, nnx.Rngs(0)), nnx.Param)
    for flax_specs in (torch_specs(linen, modules=RENAMES), torch_specs(nnx_params)):
        assert flax_specs == torch_specs_
        for mine, theirs in zip(_plans(flax_specs), _plans(torch_specs_), strict=True):
            assert describe_difference(mine, theirs) == ""
            assert mine.fingerprint == theirs.fingerprint
    assert len(_plans(torch_specs_)[1].buckets) > 2
    # Control: the raw Flax tree (sorted names, (in, out) kernels) plans differently.
    raw = plan_buckets(flax_param_specs(linen), cap_bytes=2048, first_cap_bytes=1024)
    assert raw.fingerprint != _plans(torch_specs_)[1].fingerprint
    # torch_names gives sync_gradients the plan names of a Flax gradient tree.
    assert sorted(torch_names(linen, modules=RENAMES)) == sorted(s.name for s in torch_specs_)


# Small buckets, so the flat plans hold several (a 12-layer MLP of ~3k float32 weights).
FLAT_CAP_MB = 2048 / 2**20


@pytest.fixture(scope="module")
def single_process_group():
    with one_rank_group():
        yield


def _torch_flat_plans(world_sizes: list[int]) -> dict[int, ShardPlan]:
    """torch's ZeRO-2 plan of ``TorchMLP``: from a ``ZeroRedundancyOptimizer(...,
    shard_gradients=True)`` on one rank, and for more ranks from the planner it calls."""
    import torch

    from gradsync_torch import ZeroRedundancyOptimizer
    from gradsync_torch._optim_state import param_specs_of
    from gradsync_torch.zero.plans import plan_shards

    model = TorchMLP(WIDTHS)
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(),
        torch.optim.Adam,
        shard_gradients=True,
        bucket_cap_mb=FLAT_CAP_MB,
        lr=1e-3,
    )
    plans = {1: opt.plan()}
    names, params = zip(*model.named_parameters(), strict=True)
    specs = param_specs_of(names, params, set())
    for n in world_sizes:
        plans[n] = plan_shards(
            specs,
            [0] * len(specs),
            group_count=1,
            segment_starts=[0],
            world_size=n,
            flat=True,
            cap_bytes=int(FLAT_CAP_MB * 2**20),
        )
    return plans


def test_flat_zero_plans_renamed_to_torch_have_torch_fingerprint(single_process_group) -> None:
    """A JAX flat plan renamed to torch names (shards AND bucket slots, names and shapes) is
    torch ZeRO-2's plan for the twin module: one statement, one fingerprint."""
    want = _torch_flat_plans([2, 8])
    assert want[1].kind == "flat" and len(want[8].buckets.buckets) > 2
    linen = LinenMLP(WIDTHS).init(jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
    nnx_params = nnx.state(NnxMLP(WIDTHS, nnx.Rngs(0)), nnx.Param)
    devices = sorted(jax.devices(), key=lambda d: d.id)
    for n, torch_plan_ in want.items():
        mesh = mesh_from_topology(Topology.create(n), devices[:n])
        for tree, modules in ((linen, RENAMES), (nnx_params, None)):
            tx = shard_optimizer(
                optax.adam(1e-3), mesh, partition="flat", bucket_cap_mb=FLAT_CAP_MB
            )
            flax_plan = tx.plan(tree)
            got = torch_plan(flax_plan, modules=modules)
            assert describe_difference(got.buckets, torch_plan_.buckets) == "", n
            assert got == torch_plan_, n
            assert got.fingerprint == torch_plan_.fingerprint, n
            # Control: the Flax plan itself names Flax paths with (in, out) kernels.
            assert flax_plan.fingerprint != torch_plan_.fingerprint
            kernel = next(s for s in flax_plan.buckets.slots if s.name.endswith("kernel"))
            assert (
                got.buckets.slot(torch_name(kernel.name, modules=modules)).shape
                == (kernel.shape[::-1])
            )


def test_state_round_trip_and_layout() -> None:
    linen = LinenMLP(WIDTHS).init(jax.random.key(1), jnp.zeros((1, WIDTHS[0])))
    state = to_torch_state(linen, modules=RENAMES)
    model = TorchMLP(WIDTHS)
    import torch

    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state.items()})
    x = np.random.default_rng(0).normal(size=(5, WIDTHS[0])).astype(np.float32)
    with torch.no_grad():
        torch_out = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(torch_out, LinenMLP(WIDTHS).apply(linen, x), rtol=1e-5, atol=1e-6)
    back = from_torch_state(model.state_dict(), linen, modules=RENAMES)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(linen), strict=True):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(KeyError, match=r"no parameter 'layers\.0\.bias' \(Flax 'params/Dense_0"):
        from_torch_state({}, linen, modules=RENAMES)


def _train_jax(params, x, y) -> dict:
    mesh = mesh_from_topology(Topology.create(2), sorted(jax.devices(), key=lambda d: d.id)[:2])
    model = LinenMLP(WIDTHS)

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)

    out = {}
    for name, hyper in OPTIMIZERS.items():
        if name == "sgd":
            tx = optax.sgd(hyper["lr"])
        else:
            b1, b2 = hyper["betas"]
            tx = optax.adam(hyper["lr"], b1=b1, b2=b2, eps=hyper["eps"])
        step = data_parallel_step(loss_fn, tx, mesh)
        p, s = params, tx.init(params)
        for _ in range(STEPS):
            p, s, _ = step(p, s, (x, y))
        state = {}
        if name == "adam":
            for key in ("mu", "nu"):
                for k, v in to_torch_state(getattr(s[0], key), modules=RENAMES).items():
                    state[f"{k}/{key}"] = v
        out[name] = {"params": to_torch_state(p, modules=RENAMES), "state": state}
    return out


def _relative_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.slow
def test_torch_data_parallel_and_gradsync_jax_train_the_same() -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, WIDTHS[0])).astype(np.float32)
    y = rng.normal(size=(16, WIDTHS[-1])).astype(np.float32)
    params = LinenMLP(WIDTHS).init(jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
    init = to_torch_state(params, modules=RENAMES)

    results = run_workers(train, 2, WIDTHS, init, x, y, OPTIMIZERS, STEPS)
    torch_result = results[0]
    jax_result = _train_jax(params, jnp.asarray(x), jnp.asarray(y))

    # Same plan on both sides (DataParallel's initial registration-order plan).
    assert results[1]["fingerprint"] == torch_result["fingerprint"]
    assert (
        torch_result["fingerprint"] == _plans(torch_specs(params, modules=RENAMES))[0].fingerprint
    )
    worst: dict[str, float] = {}
    for name in OPTIMIZERS:
        for rank_result in results[1:]:  # ranks agree bit for bit
            for key, value in rank_result[name]["params"].items():
                np.testing.assert_array_equal(value, torch_result[name]["params"][key])
        for kind in ("params", "state"):
            t, j = torch_result[name][kind], jax_result[name][kind]
            assert sorted(t) == sorted(j), (name, kind)
            for key in t:
                error = _relative_error(j[key], t[key])
                worst[name] = max(worst.get(name, 0.0), error)
                assert error <= RTOL, f"{name} {kind} {key}: relative error {error:.2e}"
        # The parameters moved: a test that trains nothing would pass trivially.
        final = torch_result[name]["params"]
        moved = max(float(np.abs(final[k] - init[k]).max()) for k in init)
        assert moved > 1e-3, name
    assert {k.split("/")[1] for k in jax_result["adam"]["state"]} == {"mu", "nu"}
    assert len(jax_result["adam"]["state"]) == 2 * len(init)
    print(f"worst relative error torch vs JAX: {worst}")  # shown with pytest -s
