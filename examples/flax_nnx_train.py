"""Data-parallel Flax NNX training with a sharded optimizer (ZeRO) on 8 CPU devices.

    python examples/flax_nnx_train.py                        # Adam, greedy partition
    python examples/flax_nnx_train.py --partition flat --clip 1.0
    python examples/flax_nnx_train.py --save /tmp/opt && \\
        python examples/flax_nnx_train.py --devices 4 --resume /tmp/opt

``nnx.Optimizer(model, shard_optimizer(optax.adam(...), mesh), wrt=nnx.Param)``: the Flax
code is the usual one. Each device keeps 1/8 of the Adam moments; inside ``jax.shard_map``
the gradients stay local (``value_and_local_grad``) and the sharded optimizer reduces them,
updates its share and returns the full update. The optimizer state can be saved and resumed
on another number of devices. The last line is one JSON object.
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
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=256, help="global batch size")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--clip", type=float, default=None, help="global-norm clip")
    parser.add_argument("--save", default=None, help="save the optimizer state here")
    parser.add_argument("--resume", default=None, help="load the optimizer state from here")
    args = parser.parse_args()
    # Must happen before JAX initializes its backend.
    os.environ.setdefault("XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx
    from jax import lax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    from tqdm import tqdm

    from gradsync_core import Topology
    from gradsync_jax import (
        clip_by_global_norm,
        load_optimizer_state,
        mesh_from_topology,
        save_optimizer_state,
        shard_optimizer,
        value_and_local_grad,
    )

    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = mesh_from_topology(Topology.create(jax.device_count()))

    class MLP(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.layers = nnx.List(
                [nnx.Linear(16, 128, rngs=rngs), nnx.Linear(128, 128, rngs=rngs),
                 nnx.Linear(128, 128, rngs=rngs), nnx.Linear(128, 1, rngs=rngs)]
            )  # fmt: skip

        def __call__(self, x: jax.Array) -> jax.Array:
            for layer in self.layers[:-1]:
                x = jax.nn.gelu(layer(x))
            return self.layers[-1](x)

    def names(tree):  # "layers/0/kernel" for every leaf
        return jax.tree_util.tree_map_with_path(
            lambda path, _: "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path),
            tree,
        )

    model = MLP(nnx.Rngs(0))
    inner = optax.adam(optax.cosine_decay_schedule(args.lr, args.steps))
    if args.clip is not None:  # first in the chain: it clips by the norm across devices
        inner = optax.chain(clip_by_global_norm(args.clip), inner)
    tx = shard_optimizer(inner, mesh, partition=args.partition)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # unchanged Flax API
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    if args.resume:
        # The parameters travel as a plain .npz beside the optimizer checkpoint.
        with np.load(os.path.join(args.resume, "params.npz")) as saved:
            params = jax.tree.map(lambda _, k: jnp.asarray(saved[k]), params, names(params))
        nnx.update(model, params)
        opt_state, manifest = load_optimizer_state(args.resume, tx, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        print(f"resumed optimizer state of step {manifest.step} saved on "
              f"{manifest.world_size} devices")  # fmt: skip

    # Replicate everything on the mesh but the optimizer shards, which init placed already.
    graphdef, state = nnx.split((model, optimizer))

    def sharding(x: jax.Array) -> NamedSharding:
        s = getattr(x, "sharding", None)
        return s if isinstance(s, NamedSharding) and s.mesh == mesh else NamedSharding(mesh, P())

    state = jax.device_put(state, jax.tree.map(sharding, state))
    specs = jax.tree.map(lambda x: x.sharding.spec, state)

    def local_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        model_def, params, rest = nnx.split(model, nnx.Param, ...)

        def loss_fn(params):  # mean over this device's batch
            return jnp.mean((nnx.merge(model_def, params, rest)(x) - y) ** 2)

        loss, grads = value_and_local_grad(loss_fn)(params)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), lax.pmean(loss, "dp")

    step = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=(specs, P())
        )
    )
    unsharded = jax.tree.leaves(jax.eval_shape(inner.init, params))
    unsharded = sum(x.size * x.dtype.itemsize for x in unsharded)
    print(
        f"{sum(p.size for p in jax.tree.leaves(params)):,} parameters on "
        f"{jax.device_count()} devices; optimizer state per device "
        f"{tx.state_nbytes_per_device(params):,} bytes "
        f"(unsharded {unsharded:,})"
    )

    rng = np.random.default_rng(0)
    w_true = rng.normal(size=(16, 1)).astype(np.float32) / 4
    data = NamedSharding(mesh, P("dp"))
    losses = []
    bar = tqdm(range(args.steps), desc=f"nnx {args.partition}", file=sys.stdout, mininterval=1)
    for i in bar:
        x = rng.normal(size=(args.batch, 16)).astype(np.float32)
        y = np.sin(x @ w_true)  # a smooth target the MLP can fit
        state, loss = step(state, jax.device_put(x, data), jax.device_put(y, data))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.5f}", refresh=False)
        if i % 50 == 0 or i == args.steps - 1:
            tqdm.write(f"step {i:4d}  loss {losses[-1]:.5f}")

    if args.save:
        model, optimizer = nnx.merge(graphdef, state)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        save_optimizer_state(
            args.save, tx, nnx.as_pure(optimizer.opt_state), params, step=args.steps
        )
        flat = jax.tree.leaves(jax.tree.map(lambda p, k: (k, np.asarray(p)), params, names(params)))
        np.savez(
            os.path.join(args.save, "params.npz"), **dict(zip(flat[::2], flat[1::2], strict=True))
        )
        print(f"saved the optimizer state to {args.save}")
    # A fresh run must learn; a resumed one (already trained) must not get worse.
    converged = losses[-1] < (2 * losses[0] if args.resume else losses[0] / 4)
    print(json.dumps({"example": "flax_nnx_train", "partition": args.partition,
                      "first_loss": losses[0], "last_loss": losses[-1]}))  # fmt: skip
    if not converged:
        sys.exit(f"training did not converge (loss {losses[0]:.4f} -> {losses[-1]:.4f})")


if __name__ == "__main__":
    main()
