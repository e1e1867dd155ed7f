"""Tensor + context + data parallel training of a Flax NNX model on 8 CPU devices.

    python examples/jax_tp_train.py                       # dp=2 x tp=2 x cp=2
    python examples/jax_tp_train.py --sequence-parallel   # tokens split over cp and tp
    python examples/jax_tp_train.py --skip-shared-sums    # drifts from serial, exit 1

The twin of examples/torch_tp_train.py. One call builds the step:
``data_parallel_step(loss, optax.chain(synced("dp", shared=plan), optax.adamw(lr)), mesh,
param_specs=specs, batch_spec=data)`` runs
the forward inside ``jax.shard_map``, keeps the gradients local over ``dp`` and PARTIAL over
the derived reduction groups (``plan``, from the parameters' and the input's specs), then
takes the dp mean and the model-parallel sums (bucketed, once per step); AdamW runs on the
sharded arrays. The serial model is trained beside it; the last line is one JSON object.

``--skip-shared-sums``: in JAX a replicated parameter cannot silently keep a partial
gradient (leaving ``shared`` out only moves the sums back into JAX's implicit ``psum`` at
every use), so the flag imitates what a forgotten sum does in torch: one member's partial
gradient stands in for the sum, and the model drifts.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # after the flags above: they must precede importing jax
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_shared_reductions
from gradsync_jax import (
    ColumnParallelLinear,
    RowParallelLinear,
    data_parallel_step,
    mesh_from_topology,
    nnx_functional,
    shared_param_specs,
    sync_gradients,
    synced,
    value_and_local_grad,
)


class Block(nnx.Module):
    """``x + fc2(gelu(fc1(ln(x))))``; with ``parallel`` fc1 is column- and fc2 row-parallel
    over ``tp``, with the same parameter tree as the serial block."""

    def __init__(self, dim: int, hidden: int, *, parallel: bool, sp: bool, rngs: nnx.Rngs):
        self.ln = nnx.LayerNorm(dim, rngs=rngs)
        if parallel:
            self.fc1 = ColumnParallelLinear(dim, hidden, sequence_parallel=sp, rngs=rngs)
            self.fc2 = RowParallelLinear(hidden, dim, sequence_parallel=sp, rngs=rngs)
        else:
            self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
            self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(nnx.gelu(self.fc1(self.ln(x)), approximate=False))


class Transformer(nnx.Module):
    """``depth`` blocks and a final LayerNorm on (batch, seq, dim); no attention."""

    def __init__(
        self, dim: int, hidden: int, depth: int, *, parallel: bool, sp: bool, rngs: nnx.Rngs
    ):
        kw = {"parallel": parallel, "sp": sp, "rngs": rngs}
        self.blocks = nnx.List([Block(dim, hidden, **kw) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--skip-shared-sums", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    sp = args.sequence_parallel

    topo = Topology.create(len(jax.devices()), tp=args.tp, cp=args.cp)
    mesh = mesh_from_topology(topo)
    dims = (args.dim, args.hidden, args.depth)
    serial = Transformer(*dims, parallel=False, sp=False, rngs=nnx.Rngs(0))
    apply_serial, params, _ = nnx_functional(serial)
    model = Transformer(*dims, parallel=True, sp=sp, rngs=nnx.Rngs(0))
    apply, _, specs = nnx_functional(model)  # same tree as serial: start from its weights
    data = P("dp", ("cp", "tp")) if sp else P("dp", "cp")
    shared = shared_param_specs(params, specs, data_axes=data, mesh=mesh)  # leaf order
    plan = plan_shared_reductions(shared, topo)

    def loss_fn(params, batch):  # this device's share of its replica's loss
        x, target = batch  # x.shape[0]: the replica's rows; args.seq: its whole sequence
        return ((apply(params, x) - target) ** 2).sum() / (x.shape[0] * args.seq * args.dim)

    opt = optax.adamw(args.lr)
    if args.skip_shared_sums:
        tx = opt
        train_step = _forgetful_step(loss_fn, opt, mesh, specs, data, plan, shared)
    else:  # the sync first: the dp mean, then the planned sums, once per step
        tx = optax.chain(synced("dp", shared=plan), opt)
        train_step = data_parallel_step(loss_fn, tx, mesh, param_specs=specs, batch_spec=data)

    @jax.jit
    def serial_step(params, opt_state, x, target):
        loss, grads = jax.value_and_grad(lambda p: ((apply_serial(p, x) - target) ** 2).mean())(
            params
        )
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    par_params = params  # the step shards them as param_specs says
    par_state = tx.init(par_params)
    ser_params, ser_state = params, opt.init(params)
    print(f"config: {topo.world_size} devices, topology {topo.order}: tp={topo.tp} "
          f"cp={topo.cp} dp={topo.dp}, sp={sp}; {args.steps} steps, batch {args.batch} x "
          f"{args.seq} tokens, dim {args.dim} hidden {args.hidden} depth {args.depth}, AdamW "
          f"lr {args.lr:g}; baseline: the serial model on the full batch")  # fmt: skip
    for r in plan.reductions:
        print(f"  extra sum over {r.group!r}: {len(r.names)} parameters, e.g. {r.names[:3]}")
    print(f"{'step':>4} {'loss':>10} {'serial loss':>12}")
    rng = np.random.default_rng(1)
    for step in range(args.steps):
        x = rng.standard_normal((args.batch, args.seq, args.dim)).astype(np.float32)
        target = np.tanh(x[..., ::-1])
        par_params, par_state, loss = train_step(par_params, par_state, (x, target))
        ser_params, ser_state, ser_loss = serial_step(ser_params, ser_state, x, target)
        if step % 5 == 0 or step == args.steps - 1:
            print(f"{step:>4} {float(loss):>10.5f} {float(ser_loss):>12.5f}")

    drift = max(
        float(np.abs(np.asarray(a) - np.asarray(b)).max())
        for a, b in zip(jax.tree.leaves(par_params), jax.tree.leaves(ser_params), strict=True)
    )
    print(f"max |parallel - serial| over every parameter: {drift:.2e}")
    summary = {
        "example": "jax_tp_train",
        "devices": topo.world_size,
        "tp": topo.tp,
        "cp": topo.cp,
        "dp": topo.dp,
        "sequence_parallel": sp,
        "reduction_groups": list(plan.group_names),
        "final_loss": round(float(loss), 6),
        "serial_final_loss": round(float(ser_loss), 6),
        "max_param_drift": drift,
    }
    print(json.dumps(summary))
    if drift > 1e-4:
        raise SystemExit(f"parallel training drifted from the serial model by {drift}")


def _forgetful_step(loss_fn, opt, mesh, specs, data, plan, shared):
    """The step with a forgotten sum: each planned gradient is one member's partial."""
    names = [s.name for s in shared]
    split = tuple(a for e in data[1:] for a in ((e,) if isinstance(e, str) else e))

    def local_step(params, opt_state, batch):
        loss, grads = value_and_local_grad(loss_fn, shared=plan)(params, batch)
        grads = sync_gradients(_keep_first_member(grads, plan, names), "dp", shared=plan)
        updates, opt_state = opt.update(grads, opt_state, params)
        loss = jax.lax.pmean(jax.lax.psum(loss, split), "dp")
        return optax.apply_updates(params, updates), opt_state, loss

    def place(tree, tree_specs):
        return jax.reshard(tree, jax.tree.map(lambda s: NamedSharding(mesh, s), tree_specs))

    @jax.jit
    def step(params, opt_state, batch):
        state_specs = optax.tree_map_params(
            opt, lambda _, s: s, opt_state, specs, transform_non_params=lambda _: P()
        )
        mapped = jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(specs, state_specs, data),
            out_specs=(specs, state_specs, P()),
        )
        return mapped(place(params, specs), place(opt_state, state_specs), place(batch, data))

    return step


def _keep_first_member(grads, plan, names):
    """Zero the partial gradients of all but the first member of each reduction group."""
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for name, grad in zip(names, leaves, strict=True):
        group = plan.group_of(name)
        if group is not None:
            first = jax.lax.axis_index(plan.topology.mesh_axes(group)) == 0
            grad = jnp.where(first, grad, jnp.zeros_like(grad))
        out.append(grad)
    return treedef.unflatten(out)


if __name__ == "__main__":
    main()
