"""One training state for both frameworks: a checkpoint saved by one continues in the other.

A 12-layer MLP (``Dense_10`` sorts before ``Dense_2`` in Flax, so ordering bugs show) trains 5
steps in one framework, is saved, and trains 5 more in the other; the result must match the
uninterrupted 10-step run of the first framework within ``RTOL`` relative per tensor
(``max|a - b| / max|b|``; absolute for an all-zero tensor).

Why these tolerances. Both runs do the same float32 arithmetic in another order (torch's and
XLA's kernels, gradient sums over 2, 3, 4 or 8 shards). That order alone, inside ONE framework,
already moves the result: JAX training this MLP for 10 steps on 1 device and on 2, 4 and 8
(nothing differs but the order of the gradient sum) differs by up to 2.5e-6 in the parameters
and 1.2e-5 in the moments under AdamW, 7.8e-7 and 1.0e-6 under SGD with momentum. Adam
amplifies rounding where ``nu`` is small (its update ``m / sqrt(nu)`` is scale-free), and the
moments are means of gradients whose terms cancel, so their error is large relative to their
own maximum. The tolerances are 4x that same-framework floor: 1e-5 for parameters, 5e-5 for
moments. The cross-framework runs measure 2.7e-6 (torch -> JAX) and 1.0e-5 (JAX -> torch,
a first moment), i.e. at the floor, while a wrong key, layout, bias correction or step count
errs by 1e-2 or more. Betas (0.5, 0.75) as in the parity test: float32 holds their powers
exactly, so optax's float32 bias correction agrees with torch's float64 one.
"""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx

from gradsync_core import plan_greedy_shards
from gradsync_jax import (
    from_torch_state,
    load_optimizer_state,
    save_optimizer_state,
    shard_optimizer,
    to_torch_state,
    torch_plan,
)
from gradsync_torch import load_optimizer_state_dict
from gradsync_torch import param_specs as torch_param_specs
from tests.parity import cross_worker
from tests.parity.mlp_twin import (
    RTOL,
    TORCH_HYPER,
    data,
    jax_moments,
    linen_init,
    optax_moments,
    optax_twin,
    train_jax,
)
from tests.parity.torch_worker import RENAMES, WIDTHS, TorchMLP
from tests.support.asserts import assert_close
from tests.support.harness import run_workers
from tests.support.meshes import mesh_of
from tests.support.models import LinenMLP, NnxMLP

pytestmark = pytest.mark.slow


def assert_state_dicts_equal(got: dict, want: dict) -> None:
    assert got["param_groups"] == want["param_groups"]
    assert got["state"].keys() == want["state"].keys()
    for index, entries in want["state"].items():
        for key, value in entries.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)


def train_plain_optax(tx, params, opt_state, steps: int):
    """``steps`` steps of a plain Optax optimizer on the whole batch, on one device."""
    model = LinenMLP(WIDTHS)
    x, y = (jnp.asarray(a) for a in data())

    @jax.jit
    def step(p, s):
        grads = jax.grad(lambda q: jnp.mean((model.apply(q, x) - y) ** 2))(p)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    for _ in range(steps):
        params, opt_state = step(params, opt_state)
    return params, opt_state


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_torch_checkpoint_continues_in_jax(name: str, tmp_path) -> None:
    """(a)/(c): torch 2 ranks 5 steps -> JAX 4 devices 5 steps == torch 10 steps."""
    like = linen_init()
    init = to_torch_state(like, modules=RENAMES)
    x, y = data()
    path = str(tmp_path / "ckpt")
    torch_run = run_workers(
        cross_worker.run, 2, WIDTHS, init, x, y, name, TORCH_HYPER[name], 10, 5, path
    )[0]
    params = from_torch_state(torch_run["saved_params"], like, modules=RENAMES)
    tx = shard_optimizer(optax_twin(name), mesh_of(4), partition="greedy")
    opt_state, manifest = load_optimizer_state(path, tx, params, modules=RENAMES)
    assert (manifest.framework, manifest.step, manifest.world_size) == ("torch", 5, 2)
    params, opt_state = train_jax(tx, params, opt_state, 5)
    worst = assert_close(
        to_torch_state(params, modules=RENAMES), torch_run["params"], RTOL["params"], "params"
    )
    moments = jax_moments(tx, opt_state, params, name)
    worst = max(worst, assert_close(moments, torch_run["state"], RTOL["state"], "state"))
    if name == "adamw":
        assert int(tx.gather_state(opt_state, params)[0].count) == 10
    moved = max(float(np.abs(torch_run["params"][k] - init[k]).max()) for k in init)
    assert moved > 1e-2  # it trained: a test that moves nothing would pass trivially
    print(f"torch -> JAX {name}: worst relative error {worst:.2e}")
    # The same checkpoint into a plain Optax optimizer (one device, the whole batch).
    plain = optax_twin(name)
    params = from_torch_state(torch_run["saved_params"], like, modules=RENAMES)
    plain_state, _ = load_optimizer_state(path, plain, params, modules=RENAMES)
    assert jax.tree.structure(plain_state) == jax.tree.structure(plain.init(params))
    params, plain_state = train_plain_optax(plain, params, plain_state, 5)
    worst = assert_close(
        to_torch_state(params, modules=RENAMES), torch_run["params"], RTOL["params"], "params"
    )
    moments = optax_moments(plain_state[0], name)
    worst = max(worst, assert_close(moments, torch_run["state"], RTOL["state"], "state"))
    print(f"torch -> plain Optax {name}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_jax_checkpoint_continues_in_torch(name: str, tmp_path) -> None:
    """(b)/(c): JAX 8 devices 5 steps -> torch 3 ranks 5 steps == JAX 10 steps."""
    params0 = linen_init()
    tx = shard_optimizer(optax_twin(name), mesh_of(8), partition="greedy")
    params5, state5 = train_jax(tx, params0, tx.init(params0), 5)
    path = str(tmp_path / "ckpt")
    save_optimizer_state(path, tx, state5, params5, step=5, modules=RENAMES)
    params10, state10 = train_jax(tx, params5, state5, 5)
    x, y = data()
    saved = to_torch_state(params5, modules=RENAMES)
    torch_run = run_workers(
        cross_worker.run, 3, WIDTHS, saved, x, y, name, TORCH_HYPER[name], 5, None, None, path
    )[0]
    worst = assert_close(
        torch_run["params"], to_torch_state(params10, modules=RENAMES), RTOL["params"], "params"
    )
    want = jax_moments(tx, state10, params10, name)
    worst = max(worst, assert_close(torch_run["state"], want, RTOL["state"], "state"))
    if name == "adamw":
        assert set(torch_run["steps"].values()) == {10.0}
    print(f"JAX -> torch {name}: worst relative error {worst:.2e}")
    # The same checkpoint into a plain torch optimizer in this process (the whole batch).
    net = TorchMLP(WIDTHS)
    net.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in saved.items()})
    plain = cross_worker.OPTIMIZERS[name](net.parameters(), **TORCH_HYPER[name])
    other = torch.optim.Adagrad(net.parameters(), lr=0.5)
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match=r"torch\.optim\.Adagrad"):  # no Optax twin
        load_optimizer_state_dict(path, other, net)
    assert_state_dicts_equal(other.state_dict(), before)  # nothing half-loaded
    load_optimizer_state_dict(path, plain, net)
    for _ in range(5):
        plain.zero_grad()
        torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        plain.step()
    names = [n for n, _ in net.named_parameters()]
    got = {n: p.detach().numpy() for n, p in net.named_parameters()}
    worst = assert_close(got, to_torch_state(params10, modules=RENAMES), RTOL["params"], "params")
    moments = {
        f"{names[i]}/{key}": value.numpy()
        for i, entries in plain.state_dict()["state"].items()
        for key, value in entries.items()
        if key != "step"
    }
    worst = max(worst, assert_close(moments, want, RTOL["state"], "state"))
    if name == "adamw":
        assert {float(entries["step"]) for entries in plain.state.values()} == {10.0}
    print(f"JAX -> plain torch {name}: worst relative error {worst:.2e}")


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
def test_same_owners_as_torch(world_size: int) -> None:
    """shard_optimizer's greedy owners (linen and NNX) are torch ZeRO's, fingerprint too.

    ``plan_greedy_shards`` over ``gradsync_torch.param_specs`` is torch's own
    ``ZeroRedundancyOptimizer`` assignment (checked against it in tests/torch/test_zero.py).
    """
    want = plan_greedy_shards(torch_param_specs(TorchMLP(WIDTHS)), world_size=world_size)
    linen = linen_init()
    nnx_params = nnx.state(NnxMLP(WIDTHS, nnx.Rngs(0)), nnx.Param)
    for tree, modules in ((linen, RENAMES), (nnx_params, None)):
        tx = shard_optimizer(optax.adam(1e-3), mesh_of(world_size), partition="greedy")
        got = torch_plan(tx.plan(tree), modules=modules)
        assert {s.name: s.rank for s in got.shards} == {s.name: s.rank for s in want.shards}
        assert got.fingerprint == want.fingerprint


def test_stateless_transformations_before_the_optimizer_do_not_block_the_match(tmp_path) -> None:
    """Issue 22 item 4: a torch AdamW checkpoint loads into ``chain(clip(...), adamw)`` (the
    clipping keeps no state; torch clips outside the optimizer) and continues exactly; a
    threshold no gradient reaches keeps the arithmetic torch's, so the result is comparable."""
    from gradsync_jax.checkpoint.optimizers import optimizer_name

    def types(tx):
        import re

        return tuple(re.findall(r"namedtuple\[(\w+)\]", str(jax.tree.structure(tx.init({})))))

    adamw, adam = optax_twin("adamw"), optax.adam(1e-2)
    for clip in (optax.clip(1.0), optax.clip_by_global_norm(1.0)):
        assert optimizer_name(types(optax.chain(clip, adamw))) == "adamw"
        assert optimizer_name(types(optax.chain(clip, adam))) == "adam"
        assert optimizer_name(types(optax.chain(clip, optax.sgd(0.1)))) == "sgd"
        assert optimizer_name(types(optax.chain(clip, optax.sgd(0.1, 0.9)))) == "sgd_momentum"
    assert optimizer_name(types(optax.chain(optax.clip(1.0), optax.lion(1e-3)))).startswith(
        "optax:"
    )
    like = linen_init()
    init = to_torch_state(like, modules=RENAMES)
    x, y = data()
    path = str(tmp_path / "ckpt")
    torch_run = run_workers(
        cross_worker.run, 2, WIDTHS, init, x, y, "adamw", TORCH_HYPER["adamw"], 10, 5, path
    )[0]
    clipped = optax.chain(optax.clip(1e9), optax_twin("adamw"))
    tx = shard_optimizer(clipped, mesh_of(4), partition="greedy")
    params = from_torch_state(torch_run["saved_params"], like, modules=RENAMES)
    opt_state, manifest = load_optimizer_state(path, tx, params, modules=RENAMES)
    assert manifest.optimizer == "torch.optim.AdamW"
    params, opt_state = train_jax(tx, params, opt_state, 5)
    assert_close(
        to_torch_state(params, modules=RENAMES), torch_run["params"], RTOL["params"], "params"
    )
    adam_states = jax.tree.leaves(
        tx.gather_state(opt_state, params),
        is_leaf=lambda s: isinstance(s, optax.ScaleByAdamState),
    )
    inner = next(s for s in adam_states if isinstance(s, optax.ScaleByAdamState))
    assert_close(optax_moments(inner, "adamw"), torch_run["state"], RTOL["state"], "state")
