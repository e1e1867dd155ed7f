"""Data-parallel Flax NNX training with a sharded optimizer (ZeRO) on 8 CPU devices.

    python examples/flax_nnx_train.py                      # Adam, partition="auto", 200 steps
    python examples/flax_nnx_train.py --partition flat --clip 1.0
    python examples/flax_nnx_train.py --save /tmp/nnx      # steps 0-99 of 200, then saved
    python examples/flax_nnx_train.py --resume /tmp/nnx    # steps 100-199, checked
    python examples/flax_nnx_train.py --devices 4 --resume /tmp/nnx   # on another mesh

``nnx.Optimizer(model, shard_optimizer(optax.adam(...), mesh), wrt=nnx.Param)``: the Flax
code is the usual one. Each device keeps its share of the Adam moments; inside
``jax.shard_map`` the gradients stay local (``value_and_local_grad``) and the sharded optimizer
reduces them, updates its share and returns the full update.

What it proves: a fresh run is compared with the same model trained by the unsharded
optimizer (plain Optax on one device, the full batch). ``--save`` stops at ``--stop``
(default: half of ``--steps``) and writes the weights, the sharded optimizer state and the
run's settings; ``--resume`` continues the same run: the learning-rate schedule over the total
steps, the step count and the data stream carry on where they stopped, and the result is
compared with an uninterrupted run of the same settings. Each comparison prints its largest
difference and fails the script above ``--tolerance``. Progress bars go to stderr; the last
stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys

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
from training_run import (  # beside this script
    FEATURES,
    add_run_arguments,
    batch,
    report,
    resolve,
    state_sizes,
    write_run,
)

from gradsync_core import Topology
from gradsync_jax import (
    clip_by_global_norm,
    load_optimizer_state,
    load_params,
    mesh_from_topology,
    save_optimizer_state,
    shard_optimizer,
    value_and_local_grad,
)

HIDDEN = 128


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.layers = nnx.List(
            [nnx.Linear(FEATURES, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, HIDDEN, rngs=rngs),
             nnx.Linear(HIDDEN, HIDDEN, rngs=rngs), nnx.Linear(HIDDEN, 1, rngs=rngs)]
        )  # fmt: skip

    def __call__(self, x: jax.Array) -> jax.Array:
        for layer in self.layers[:-1]:
            x = jax.nn.gelu(layer(x))
        return self.layers[-1](x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    args = resolve(parser, parser.parse_args())
    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = mesh_from_topology(Topology.create(jax.device_count()))
    schedule = optax.cosine_decay_schedule(args.lr, args.steps)  # over the TOTAL steps
    inner = optax.adam(schedule)
    if args.clip is not None:  # first in the chain: it clips by the norm across devices
        inner = optax.chain(clip_by_global_norm(args.clip), inner)
    tx = shard_optimizer(inner, mesh, partition=args.partition)
    print(f"config: {jax.device_count()} devices, partition={args.partition!r}, "
          f"steps {args.start}..{args.stop} of {args.steps}, batch {args.batch}, "
          f"cosine lr {args.lr:g}, clip {args.clip}")  # fmt: skip

    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)  # unchanged Flax API
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    _print_state_sizes(tx, inner, params)
    if args.resume:
        nnx.update(model, load_params(args.resume, params))
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        opt_state, manifest = load_optimizer_state(args.resume, tx, params)
        nnx.update(optimizer.opt_state, nnx.state(opt_state))
        optimizer.step.value = jnp.asarray(manifest.step, optimizer.step.value.dtype)
        print(f"resumed at step {manifest.step} (saved on {manifest.world_size} devices): "
              f"learning rate {float(schedule(manifest.step)):.3e}")  # fmt: skip

    step, state = _sharded_step(mesh, model, optimizer)
    state, losses = train(step, state, args, desc=f"nnx {args.partition}")
    if args.save:
        _save(args, tx, state, step.graphdef)

    if args.resume:  # the baseline: the same run, never interrupted
        fresh_model = MLP(nnx.Rngs(0))
        _, fresh = _sharded_step(mesh, fresh_model, nnx.Optimizer(fresh_model, tx, wrt=nnx.Param))
        fresh, reference = train(step, fresh, args, start=0, desc="uninterrupted")
        baseline = "an uninterrupted run of the same settings"
        ours, theirs = _params(step.graphdef, state), _params(step.graphdef, fresh)
        reference = reference[args.start :]
    else:  # the baseline: the unsharded optimizer on one device, the full batch
        baseline = "the unsharded optimizer (plain Optax, one device)"
        theirs, reference = _unsharded_run(inner, args)
        ours = _params(step.graphdef, state)
    ours, theirs = jax.tree.leaves(ours), jax.tree.leaves(theirs)
    report("flax_nnx_train", args, losses, reference, ours, theirs, baseline)


def _print_state_sizes(tx, inner, params) -> None:
    unsharded = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(inner.init, params))
    )
    count = sum(p.size for p in jax.tree.leaves(params))
    per_device = tx.state_nbytes_per_device(params)
    print(state_sizes(per_device, unsharded, jax.device_count(), count))


class _Step:
    """The jitted shard_map step and the graph definition its state belongs to."""

    def __init__(self, graphdef, fn, mesh) -> None:
        self.graphdef, self.fn, self.mesh = graphdef, fn, mesh

    def __call__(self, state, x, y):
        return self.fn(state, x, y)


def _sharded_step(mesh, model, optimizer):
    """Replicate everything on the mesh but the optimizer shards, which init placed already;
    return the step and the placed state."""
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

    fn = jax.jit(
        jax.shard_map(
            local_step, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=(specs, P())
        )
    )
    return _Step(graphdef, fn, mesh), state


def train(step, state, args, *, start: int | None = None, desc: str):
    """Steps ``start..args.stop`` (default ``args.start``); returns the state and losses."""
    start = args.start if start is None else start
    data = NamedSharding(step.mesh, P("dp"))
    schedule = optax.cosine_decay_schedule(args.lr, args.steps)
    losses = []
    bar = tqdm(range(start, args.stop), desc=desc, file=sys.stderr, mininterval=1)
    for i in bar:
        x, y = batch(i, args.batch)
        state, loss = step(state, jax.device_put(x, data), jax.device_put(y, data))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.5f}", refresh=False)
        if desc != "uninterrupted" and (i % 50 == 0 or i in (start, args.stop - 1)):
            tqdm.write(f"step {i:4d}  loss {losses[-1]:.6f}  lr {float(schedule(i)):.3e}",
                       file=sys.stdout)  # fmt: skip
    return state, losses


def _params(graphdef, state):
    model, _ = nnx.merge(graphdef, state)
    return jax.tree.map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param)))


def _unsharded_run(inner, args):
    """The same model and optimizer without gradsync: plain Optax, one device, full batch."""
    model = MLP(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, inner, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
        optimizer.update(model, grads)
        return loss

    losses = [float(step(model, optimizer, *batch(i, args.batch))) for i in range(args.stop)]
    return jax.tree.map(np.asarray, nnx.as_pure(nnx.state(model, nnx.Param))), losses


def _save(args, tx, state, graphdef) -> None:
    model, optimizer = nnx.merge(graphdef, state)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    opt_state = nnx.as_pure(optimizer.opt_state)
    save_optimizer_state(args.save, tx, opt_state, params, step=args.stop, model=params)
    write_run(args)
    print(f"saved the weights and optimizer state of step {args.stop} to {args.save}")


if __name__ == "__main__":
    main()
