"""Data-parallel Flax linen training with a sharded optimizer (ZeRO) on 8 CPU devices.

    python examples/flax_linen_train.py                     # AdamW, greedy partition
    python examples/flax_linen_train.py --partition flat --clip 1.0
    python examples/flax_linen_train.py --optimizer adafactor   # greedy only: not elementwise

``TrainState.create(apply_fn=..., params=..., tx=shard_optimizer(optax.adamw(...), mesh))``
and ``state.apply_gradients(grads=grads)``: the Flax code is the usual one. Each device keeps
1/8 of the optimizer state; inside ``jax.shard_map`` the gradients stay local
(``value_and_local_grad``) and the sharded optimizer reduces them, updates its share and
returns the full update. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices")
    parser.add_argument("--partition", choices=("greedy", "flat"), default="greedy")
    parser.add_argument("--optimizer", choices=("adamw", "adafactor", "lion"), default="adamw")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=None, help="global-norm clip")
    args = parser.parse_args()
    # Must happen before JAX initializes its backend.
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import flax.linen as nn
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax.training.train_state import TrainState
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from gradsync_core import Topology
    from gradsync_jax import (
        clip_by_global_norm,
        mesh_from_topology,
        shard_optimizer,
        value_and_local_grad,
    )

    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = mesh_from_topology(Topology.create(jax.device_count()))

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for width in (128, 128, 128):
                x = jax.nn.gelu(nn.Dense(width)(x))
            return nn.Dense(1)(x)

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, 16)))["params"]
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, args.steps)
    inner = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=1e-4),
        "adafactor": lambda: optax.adafactor(schedule),
        "lion": lambda: optax.lion(lambda count: schedule(count) / 3),
    }[args.optimizer]()
    if args.clip is not None:  # first in the chain: it clips by the norm across devices
        inner = optax.chain(clip_by_global_norm(args.clip), inner)
    tx = shard_optimizer(inner, mesh, partition=args.partition)
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(params, replicated)
    state = TrainState.create(apply_fn=model.apply, params=params, tx=tx)  # unchanged Flax
    state = state.replace(step=jax.device_put(jnp.asarray(state.step), replicated))
    # params and step replicated, opt_state as tx.init placed it (its shards over dp).
    specs = jax.tree.map(lambda x: x.sharding.spec, state)
    plan = tx.plan(params)

    def local_step(state, x, y):
        def loss_fn(params):  # mean over this device's batch
            return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

        loss, grads = value_and_local_grad(loss_fn)(state.params)
        return state.apply_gradients(grads=grads), lax.pmean(loss, "dp")

    step = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=(specs, P())
        )
    )
    unsharded = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(inner.init, params))
    )
    print(
        f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters on "
        f"{jax.device_count()} devices, {args.optimizer} ({args.partition}: imbalance "
        f"{plan.imbalance:.3f}, padding {plan.padding_numel} elements); optimizer state per "
        f"device {tx.state_nbytes_per_device(params):,} bytes (unsharded {unsharded:,})"
    )

    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(16, 1)).astype(np.float32) / 4
    data = NamedSharding(mesh, P("dp"))
    losses = []
    bar = tqdm(range(args.steps), desc=f"linen {args.optimizer}", file=sys.stdout, mininterval=1)
    for i in bar:
        x = rng.normal(size=(args.batch, 16)).astype(np.float32)
        y = np.sin(x @ w_true)  # a smooth target the MLP can fit
        state, loss = step(state, jax.device_put(x, data), jax.device_put(y, data))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.5f}", refresh=False)
        if i % 50 == 0 or i == args.steps - 1:
            tqdm.write(f"step {i:4d}  loss {losses[-1]:.5f}")
    print(json.dumps({"example": "flax_linen_train", "optimizer": args.optimizer,
                      "partition": args.partition, "first_loss": losses[0],
                      "last_loss": losses[-1]}))  # fmt: skip
    if not losses[-1] < losses[0] / 4:
        sys.exit(f"training did not converge (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
