"""A JAX ZeRO-3 checkpoint continues in torch: one format for every executor.

The 12-layer MLP of test_cross_checkpoint.py (its last layer has 4 rows: fewer than the 8
devices, so padded chunks) trains 5 AdamW steps under ``zero3_step`` on 8 devices, one unit per
layer, and is saved with ``save_param_shards``. It then trains 5 more steps in torch, once with
a plain ``torch.optim.AdamW`` in this process (the weights read by ``load_model_weights``, the
state by ``load_optimizer_state_dict``) and once with gradsync_torch's ZeRO-1 at 3 gloo ranks
(``ZeroRedundancyOptimizer.load``); both must equal JAX's uninterrupted 10 ZeRO-3 steps within
test_cross_checkpoint.py's cross-framework floor, parameters and both moments.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import torch

from gradsync_jax import param_layout, shard_params, to_torch_state, unshard_params, zero3_step
from gradsync_jax.checkpoint.param_shards import save_param_shards
from gradsync_torch import load_model_weights, load_optimizer_state_dict
from tests.parity import cross_worker
from tests.parity.test_cross_checkpoint import (
    RENAMES,
    TORCH_HYPER,
    WIDTHS,
    LinenMLP,
    assert_close,
    data,
    linen_init,
    optax_moments,
    optax_twin,
)
from tests.parity.torch_worker import TorchMLP
from tests.torch.harness import run_workers

UNITS = [f"Dense_{i}" for i in range(len(WIDTHS) - 1)]


def loss_fn(params, batch):
    return jnp.mean((LinenMLP().apply(params, batch[0]) - batch[1]) ** 2)


def train(step, params, opt_state, steps: int):
    batch = tuple(jnp.asarray(a) for a in data())
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, batch)
    return params, opt_state


def moments(step, opt_state) -> dict[str, np.ndarray]:
    """``"<torch name>/<torch key>"`` -> whole moment, from a sharded ZeRO-3 state."""
    adam = opt_state[0]
    whole = adam._replace(
        mu=unshard_params(adam.mu, step.layout), nu=unshard_params(adam.nu, step.layout)
    )
    return optax_moments(whole, "adamw")


def test_jax_zero3_checkpoint_continues_in_torch(tmp_path) -> None:
    from tests.parity.test_cross_checkpoint import mesh_of

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
    worst = assert_close(got, want_params, "params")
    names = [n for n, _ in net.named_parameters()]
    got_state = {
        f"{names[i]}/{key}": value.numpy()
        for i, entries in plain.state_dict()["state"].items()
        for key, value in entries.items()
        if key != "step"
    }
    worst = max(worst, assert_close(got_state, want_state, "state"))
    assert {float(entries["step"]) for entries in plain.state.values()} == {10.0}
    print(f"JAX ZeRO-3 -> plain torch: worst relative error {worst:.2e}")

    # gradsync_torch ZeRO-1 at 3 ranks, the batch split.
    hyper = TORCH_HYPER["adamw"]
    run = run_workers(cross_worker.run, 3, WIDTHS, saved, x, y, "adamw", hyper, 5, None, None, path)
    worst = assert_close(run[0]["params"], want_params, "params")
    worst = max(worst, assert_close(run[0]["state"], want_state, "state"))
    assert set(run[0]["steps"].values()) == {10.0}
    print(f"JAX ZeRO-3 -> torch ZeRO-1 at 3 ranks: worst relative error {worst:.2e}")
