"""Data-parallel Flax linen training with a sharded optimizer (ZeRO) on 8 CPU devices.

    python examples/flax_linen_train.py                     # AdamW, partition="auto"
    python examples/flax_linen_train.py --partition flat --clip 1.0
    python examples/flax_linen_train.py --optimizer adafactor   # not elementwise: greedy
    python examples/flax_linen_train.py --save /tmp/linen   # steps 0-99 of 200, then saved
    python examples/flax_linen_train.py --resume /tmp/linen # steps 100-199, checked

``TrainState.create(apply_fn=..., params=..., tx=shard_optimizer(optax.adamw(...), mesh))``
and ``state.apply_gradients(grads=grads)``: the Flax code is the usual one. Each device keeps
its share of the optimizer state; inside ``jax.shard_map`` the gradients stay local
(``value_and_local_grad``) and the sharded optimizer reduces them, updates its share and
returns the full update.

What it proves: a fresh run is compared with the same model trained by the unsharded
optimizer (plain Optax on one device, the full batch). ``--save`` stops at ``--stop``
(default: half of ``--steps``) and writes the weights, the sharded optimizer state and the
run's settings; ``--resume`` continues the same run (the schedule over the total steps,
``TrainState.step``, the data stream) and is compared with an uninterrupted run. Each
comparison prints its largest difference and fails the script above ``--tolerance``.
Progress bars go to stderr; the last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import os
import sys

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


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for width in (128, 128, 128):
            x = jax.nn.gelu(nn.Dense(width)(x))
        return nn.Dense(1)(x)


def make_optimizer(name: str, args: argparse.Namespace) -> optax.GradientTransformation:
    """The inner (unsharded) optimizer, its schedule over the run's total steps."""
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, args.steps)
    inner = {
        "adamw": lambda: optax.adamw(schedule, weight_decay=1e-4),
        "adafactor": lambda: optax.adafactor(schedule),
        "lion": lambda: optax.lion(lambda count: schedule(count) / 3),
    }[name]()
    if args.clip is not None:  # first in the chain: it clips by the norm across devices
        inner = optax.chain(clip_by_global_norm(args.clip), inner)
    return inner


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_run_arguments(parser)
    parser.add_argument("--optimizer", choices=("adamw", "adafactor", "lion"), default="adamw")
    args = resolve(parser, parser.parse_args())
    jax.config.update("jax_num_cpu_devices", args.devices)
    mesh = mesh_from_topology(Topology.create(jax.device_count()))
    inner = make_optimizer(args.optimizer, args)
    tx = shard_optimizer(inner, mesh, partition=args.partition)
    schedule = optax.warmup_cosine_decay_schedule(0.0, args.lr, 10, args.steps)
    print(f"config: {jax.device_count()} devices, {args.optimizer}, partition="
          f"{args.partition!r}, steps {args.start}..{args.stop} of {args.steps}, batch "
          f"{args.batch}, warmup-cosine lr {args.lr:g}, clip {args.clip}")  # fmt: skip

    model = MLP()
    params = model.init(jax.random.key(0), jnp.zeros((1, FEATURES)))["params"]
    plan = tx.plan(params)
    unsharded = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves(jax.eval_shape(inner.init, params))
    )
    count = sum(p.size for p in jax.tree.leaves(params))
    print(state_sizes(tx.state_nbytes_per_device(params), unsharded, jax.device_count(), count))
    print(f"partition: imbalance {plan.imbalance:.3f}, padding {plan.padding_numel} elements")

    step = sharded_step(mesh, model, tx, params)
    state = step.init(params)
    if args.resume:
        loaded = jax.device_put(load_params(args.resume, params), step.replicated)
        opt_state, manifest = load_optimizer_state(args.resume, tx, loaded)
        count = jax.device_put(jnp.asarray(manifest.step, state.step.dtype), step.replicated)
        state = state.replace(step=count, params=loaded, opt_state=opt_state)
        print(f"resumed at step {manifest.step} (saved on {manifest.world_size} devices): "
              f"learning rate {float(schedule(manifest.step)):.3e}")  # fmt: skip
    state, losses = train(step, state, args, schedule, desc=f"linen {args.optimizer}")
    if args.save:
        save_optimizer_state(
            args.save, tx, state.opt_state, state.params, step=args.stop, model=state.params
        )
        write_run(args)
        print(f"saved the weights and optimizer state of step {args.stop} to {args.save}")

    if args.resume:  # the baseline: the same run, never interrupted
        fresh, reference = train(step, step.init(params), args, schedule, start=0, desc=None)
        baseline, theirs = "an uninterrupted run of the same settings", fresh.params
        reference = reference[args.start :]
    else:  # the baseline: the unsharded optimizer on one device, the full batch
        baseline = "the unsharded optimizer (plain Optax, one device)"
        theirs, reference = unsharded_run(model, inner, params, args)
    ours = [np.asarray(p) for p in jax.tree.leaves(state.params)]
    theirs = [np.asarray(p) for p in jax.tree.leaves(theirs)]
    report("flax_linen_train", args, losses, reference, ours, theirs, baseline)


class sharded_step:
    """The jitted shard_map train step over ``mesh``, and how to place a fresh state."""

    def __init__(self, mesh, model, tx, params) -> None:
        self.mesh, self.model, self.tx = mesh, model, tx
        self.replicated = NamedSharding(mesh, P())
        # params and step replicated, opt_state as tx.init placed it (its shards over dp).
        specs = jax.tree.map(lambda x: x.sharding.spec, self.init(params))

        def local_step(state, x, y):
            def loss_fn(params):  # mean over this device's batch
                return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

            loss, grads = value_and_local_grad(loss_fn)(state.params)
            return state.apply_gradients(grads=grads), lax.pmean(loss, "dp")

        self.fn = jax.jit(
            jax.shard_map(
                local_step, mesh=mesh, in_specs=(specs, P("dp"), P("dp")), out_specs=(specs, P())
            )
        )

    def init(self, params) -> TrainState:
        """A step-0 ``TrainState`` placed on the mesh (unchanged Flax ``create``)."""
        params = jax.device_put(params, self.replicated)
        state = TrainState.create(apply_fn=self.model.apply, params=params, tx=self.tx)
        return state.replace(step=jax.device_put(jnp.asarray(state.step), self.replicated))

    def __call__(self, state, x, y):
        data = NamedSharding(self.mesh, P("dp"))
        return self.fn(state, jax.device_put(x, data), jax.device_put(y, data))


def train(step, state, args, schedule, *, start: int | None = None, desc: str | None):
    """Steps ``start..args.stop`` (default ``args.start``); ``desc=None``: no log lines."""
    start = args.start if start is None else start
    losses = []
    bar = tqdm(range(start, args.stop), desc=desc or "uninterrupted", file=sys.stderr,
               mininterval=1)  # fmt: skip
    for i in bar:
        state, loss = step(state, *batch(i, args.batch))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.5f}", refresh=False)
        if desc and (i % 50 == 0 or i in (start, args.stop - 1)):
            tqdm.write(f"step {i:4d}  loss {losses[-1]:.6f}  lr {float(schedule(i)):.3e}",
                       file=sys.stdout)  # fmt: skip
    return state, losses


def unsharded_run(model, inner, params, args):
    """The same model and optimizer without gradsync: plain Optax, one device, full batch."""

    @jax.jit
    def step(params, opt_state, x, y):
        loss, grads = jax.value_and_grad(
            lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2)
        )(params)
        updates, opt_state = inner.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params = jax.device_put(params, jax.devices()[0])
    opt_state, losses = inner.init(params), []
    for i in range(args.stop):
        params, opt_state, loss = step(params, opt_state, *batch(i, args.batch))
        losses.append(float(loss))
    return params, losses


if __name__ == "__main__":
    main()
