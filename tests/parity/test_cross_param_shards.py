"""ZeRO-3 checkpoints cross frameworks, both ways: one plan, one format for every executor.

The 12-layer MLP of test_cross_checkpoint.py (its last layer has 4 rows: fewer than the 8
devices, so padded chunks) trains 5 AdamW steps under ``zero3_step`` on 8 devices, one unit per
layer, and is saved with ``save_param_shards``. It then trains 5 more steps in torch, once with
a plain ``torch.optim.AdamW`` in this process (the weights read by ``load_model_weights``, the
state by ``load_optimizer_state_dict``) and once with gradsync_torch's ZeRO-1 at 3 gloo ranks
(``ZeroRedundancyOptimizer.load``); both must equal JAX's uninterrupted 10 ZeRO-3 steps within
test_cross_checkpoint.py's cross-framework floor, parameters and both moments.

The other way, torch's ``fully_shard`` (zero3_worker.py's tied,
frozen ``TiedLM``, one unit per layer, the frozen layer and the root) trains 3 steps at 2 gloo
ranks and saves with ``save_param_shards``; the Flax twin's plan at 2 devices has the
fingerprint of the plan torch executed, and ``load_param_shards`` continues it on 4 devices
for 3 more steps, equal to torch's uninterrupted single-process run of 6 within the floor.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from gradsync_jax import param_layout, shard_params, to_torch_state, unshard_params, zero3_step
from gradsync_jax.checkpoint.param_shards import load_param_shards, save_param_shards
from gradsync_torch import load_model_weights, load_optimizer_state_dict
from tests.parity import cross_worker
from tests.parity.mlp_twin import (
    RTOL,
    TORCH_HYPER,
    data,
    linen_init,
    optax_moments,
    optax_twin,
)
from tests.parity.torch_worker import RENAMES, WIDTHS, TorchMLP
from tests.support.asserts import assert_close
from tests.support.harness import run_workers
from tests.support.meshes import mesh_of
from tests.support.models import LinenMLP

pytestmark = pytest.mark.slow

UNITS = [f"Dense_{i}" for i in range(len(WIDTHS) - 1)]


def loss_fn(params, batch):
    return jnp.mean((LinenMLP(WIDTHS).apply(params, batch[0]) - batch[1]) ** 2)


def train(step, params, opt_state, steps: int):
    batch = tuple(jnp.asarray(a) for a in data())
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, batch)
    return params, opt_state


def moments(step, opt_state, modules=RENAMES) -> dict[str, np.ndarray]:
    """``"<torch name>/<torch key>"`` -> whole moment, from a sharded ZeRO-3 state."""
    adam = opt_state[0]
    whole = adam._replace(
        mu=unshard_params(adam.mu, step.layout), nu=unshard_params(adam.nu, step.layout)
    )
    return optax_moments(whole, "adamw", modules)


def test_jax_zero3_checkpoint_continues_in_torch(tmp_path) -> None:
    params0 = linen_init()
    layout = param_layout(params0, world_size=8, units=UNITS, modules=RENAMES)
    step = zero3_step(loss_fn, optax_twin("adamw"), mesh_of(8), layout)
    sharded = shard_params(params0, step.mesh, layout)
    params5, state5 = train(step, sharded, step.init(sharded), 5)
    path = str(tmp_path / "ckpt")
    save_param_shards(path, step, params5, state5, step=5)
    params10, state10 = train(step, params5, state5, 5)
    want_params = to_torch_state(unshard_params(params10, layout), modules=RENAMES)
    want_state = moments(step, state10)
    saved = to_torch_state(unshard_params(params5, layout), modules=RENAMES)
    x, y = data()

    # Plain torch AdamW, one process, the whole batch: weights and state from the checkpoint.
    net = TorchMLP(WIDTHS)
    load_model_weights(path, net)
    for name, weight in net.named_parameters():
        np.testing.assert_array_equal(weight.detach().numpy(), saved[name])
    plain = torch.optim.AdamW(net.parameters(), **TORCH_HYPER["adamw"])
    load_optimizer_state_dict(path, plain, net)
    for _ in range(5):
        plain.zero_grad()
        torch.nn.functional.mse_loss(net(torch.from_numpy(x)), torch.from_numpy(y)).backward()
        plain.step()
    got = {n: p.detach().numpy() for n, p in net.named_parameters()}
    worst = assert_close(got, want_params, RTOL["params"], "params")
    names = [n for n, _ in net.named_parameters()]
    got_state = {
        f"{names[i]}/{key}": value.numpy()
        for i, entries in plain.state_dict()["state"].items()
        for key, value in entries.items()
        if key != "step"
    }
    worst = max(worst, assert_close(got_state, want_state, RTOL["state"], "state"))
    assert {float(entries["step"]) for entries in plain.state.values()} == {10.0}
    print(f"JAX ZeRO-3 -> plain torch: worst relative error {worst:.2e}")

    # gradsync_torch ZeRO-1 at 3 ranks, the batch split.
    hyper = TORCH_HYPER["adamw"]
    run = run_workers(cross_worker.run, 3, WIDTHS, saved, x, y, "adamw", hyper, 5, None, None, path)
    worst = assert_close(run[0]["params"], want_params, RTOL["params"], "params")
    worst = max(worst, assert_close(run[0]["state"], want_state, RTOL["state"], "state"))
    assert set(run[0]["steps"].values()) == {10.0}
    print(f"JAX ZeRO-3 -> torch ZeRO-1 at 3 ranks: worst relative error {worst:.2e}")


def test_torch_zero3_checkpoint_continues_in_jax_zero3(tmp_path) -> None:
    from tests.parity import tied_twin as tied
    from tests.parity import zero3_worker

    tokens, labels = tied.data()
    path, saved_at, more = str(tmp_path / "z3"), 3, 3
    torch_run = run_workers(zero3_worker.save_zero3, 2, tokens, labels, path, saved_at)[0]
    like = tied.linen_init()
    units = ["frozen", *tied.RENAMES]

    def layout(n: int):
        return param_layout(
            like, world_size=n, units=units, frozen=["frozen"], modules=tied.RENAMES
        )

    assert layout(2).plan.fingerprint == torch_run["fingerprint"], torch_run["plan"]
    model = tied.TiedLinen()

    def tied_loss(params, batch):
        logits = model.apply(params, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    step = zero3_step(tied_loss, tied.adamw(), mesh_of(4), layout(4))
    params, state, manifest = load_param_shards(path, step)
    assert (manifest.framework, manifest.world_size, manifest.plan.kind) == ("torch", 2, "dim0")
    loaded = to_torch_state(unshard_params(params, step.layout), modules=tied.RENAMES)
    for name, value in torch_run["params"].items():  # the same bytes, now on 4 devices
        np.testing.assert_array_equal(loaded[name], value, err_msg=name)
    for key, value in moments(step, state, tied.RENAMES).items():
        np.testing.assert_array_equal(value, torch_run["state"][key], err_msg=key)
    batch = tuple(jnp.asarray(a) for a in (tokens, labels))
    for _ in range(more):
        params, state, _ = step(params, state, batch)
    want = zero3_worker.reference(tokens, labels, saved_at + more)
    got = to_torch_state(unshard_params(params, step.layout), modules=tied.RENAMES)
    worst = assert_close(got, want["params"], RTOL["params"], "params")
    worst = max(
        worst,
        assert_close(moments(step, state, tied.RENAMES), want["state"], RTOL["state"], "state"),
    )
    assert int(state[0].count) == saved_at + more
    print(f"torch ZeRO-3 at 2 ranks -> JAX ZeRO-3 on 4 devices: worst relative error {worst:.2e}")
