"""Data-parallel training of a Flax model with gradsync_jax (nnx or linen).

Runs on 8 CPU devices by default (fake host devices), so it works on a laptop:

    python examples/flax_dp_train.py                     # nnx MLP, Adam, 50 steps
    python examples/flax_dp_train.py --api linen --accumulate 4
    python examples/flax_dp_train.py --devices 4 --reduce-dtype bfloat16

gradsync builds the mesh from a Topology (devices placed by rank), keeps gradients local
inside ``shard_map`` and reduces them once over ``dp`` (docs/design.md §7); the step is one jitted
function and the script never calls ``pcast``/``pmean`` itself.

The baseline: the same model and optimizer in plain JAX on one device with the full batch;
the largest relative parameter difference is printed and, with float32 reductions, must stay
under ``--tolerance``.
"""

from __future__ import annotations

import argparse
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--api", choices=("nnx", "linen"), default="nnx")
    parser.add_argument("--devices", type=int, default=8, help="fake CPU devices")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--batch", type=int, default=128, help="global batch size")
    parser.add_argument("--accumulate", type=int, default=1, help="micro-steps per sync")
    parser.add_argument("--reduce-dtype", choices=("float32", "bfloat16"), default=None)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative diff")
    args = parser.parse_args()
    # Must happen before JAX initializes its backend.
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from gradsync_core import Topology
    from gradsync_jax import data_parallel_step, mesh_from_topology, synced

    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = mesh_from_topology(Topology.create(jax.device_count()))  # 1-D here: dp = all
    print(f"mesh {dict(mesh.shape)} on {jax.device_count()} {jax.default_backend()} devices")
    print(f"config: {args.api}, {args.steps} steps, global batch {args.batch}, "
          f"{args.accumulate} micro-steps per sync, reductions in "
          f"{args.reduce_dtype or 'the gradient dtype'}, Adam lr 3e-3; baseline: plain JAX on "
          "one device, full batch")  # fmt: skip

    if args.api == "nnx":
        from flax import nnx

        class MLP(nnx.Module):
            def __init__(self, rngs: nnx.Rngs) -> None:
                self.layers = nnx.List(
                    [nnx.Linear(16, 64, rngs=rngs), nnx.Linear(64, 64, rngs=rngs),
                     nnx.Linear(64, 1, rngs=rngs)]
                )  # fmt: skip

            def __call__(self, x: jax.Array) -> jax.Array:
                for layer in self.layers[:-1]:
                    x = jax.nn.gelu(layer(x))
                return self.layers[-1](x)

        graphdef, params = nnx.split(MLP(nnx.Rngs(0)), nnx.Param)

        def predict(params, x):
            return nnx.merge(graphdef, params)(x)
    else:
        import flax.linen as nn

        class MLP(nn.Module):
            @nn.compact
            def __call__(self, x: jax.Array) -> jax.Array:
                x = jax.nn.gelu(nn.Dense(64)(x))
                x = jax.nn.gelu(nn.Dense(64)(x))
                return nn.Dense(1)(x)

        model = MLP()
        params = model.init(jax.random.key(0), jnp.zeros((1, 16)))
        predict = model.apply

    def loss_fn(params, batch):  # mean over whatever batch it is given (here: local)
        x, y = batch
        return jnp.mean((predict(params, x) - y) ** 2)

    # The sync is the first transformation: the mean over dp, in bf16 on the wire if asked.
    wire = jnp.bfloat16 if args.reduce_dtype == "bfloat16" else None
    adam = optax.adam(3e-3)
    tx = optax.chain(synced("dp", reduce_dtype=wire), adam)
    step = data_parallel_step(loss_fn, tx, mesh, accumulate_steps=args.accumulate)
    opt_state = tx.init(params)

    @jax.jit
    def serial_step(params, opt_state, batch):  # the baseline: no gradsync, one device
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = adam.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    serial = (jax.device_put(params, jax.devices()[0]), adam.init(params))
    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(16, 1)).astype(np.float32) / 4
    first = None
    for i in range(args.steps):
        x = rng.normal(size=(args.batch, 16)).astype(np.float32)
        y = np.sin(x @ w_true)  # a smooth target the MLP can fit
        params, opt_state, loss = step(params, opt_state, (x, y))
        *serial, serial_loss = serial_step(*serial, (x, y))
        first = float(loss) if first is None else first
        if i % 10 == 0 or i == args.steps - 1:
            print(f"step {i:4d}  loss {float(loss):.5f}  baseline {float(serial_loss):.5f}")
    diff = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max() / np.abs(np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(serial[0]), strict=True)
    )
    print(f"largest relative parameter difference from the baseline: {diff:.2e}")
    if not float(loss) < first / 4:
        sys.exit(f"training did not converge (loss {first:.4f} -> {float(loss):.4f})")
    if diff > args.tolerance and args.reduce_dtype != "bfloat16":
        sys.exit(f"differs from the baseline by {diff:.2e} (tolerance {args.tolerance})")


if __name__ == "__main__":
    main()
