"""Data-parallel step on 8 CPU devices: per-leaf ``pmean`` vs gradsync's sync (docs/design.md §11).

All variants are the same jitted ``shard_map`` step (local gradients, one reduction, Adam)
and differ only in the reduction:

- anchor: ``lax.pmean`` on every gradient leaf (what a careful user writes by hand);
- gradsync: ``data_parallel_step`` with its default sync (per-leaf, divide-before-sum);
- bucketed: ``data_parallel_step`` with a 25 MiB bucket plan (one ``psum`` per bucket).

They run alternating in one process, one step each per round; the figure is the median
step time after warm-up. Last line: one JSON object.

    python benchmarks/jax_dp.py            # ~10M-parameter MLP
    python benchmarks/jax_dp.py --quick    # fewer rounds, < 2 minutes on 2 cores
    python benchmarks/jax_dp.py --repeat 5 # the whole run 5 times: median and range of ratios
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import add_repeat_arg, finish, run_repeats
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_buckets
from gradsync_jax import (
    data_parallel_step,
    mesh_from_topology,
    param_specs,
    synced,
    value_and_local_grad,
)


def make_mlp(layers: int, width: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    scale = 1.0 / np.sqrt(width)
    return {
        f"layer_{i}": {
            "kernel": jnp.asarray(rng.normal(0, scale, (width, width)), jnp.float32),
            "bias": jnp.zeros((width,), jnp.float32),
        }
        for i in range(layers)
    }


def loss_fn(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    x, y = batch
    for i in range(len(params)):
        layer = params[f"layer_{i}"]
        x = jnp.tanh(x @ layer["kernel"] + layer["bias"])
    return jnp.mean((x - y) ** 2)


def anchor_step(tx: optax.GradientTransformation, mesh: jax.sharding.Mesh):
    """The hand-written reference: local gradients, ``lax.pmean`` per leaf, Adam."""

    def local(params, opt_state, batch):
        loss, grads = value_and_local_grad(loss_fn)(params, batch)
        grads = jax.tree.map(lambda g: lax.pmean(g, "dp"), grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "dp")

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), P(), P("dp")), out_specs=(P(), P(), P())
    )
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

    @jax.jit
    def step(params, opt_state, batch):
        params, opt_state = jax.reshard((params, opt_state), replicated)
        return mapped(params, opt_state, jax.reshard(batch, sharded))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 2 minutes)")
    parser.add_argument("--layers", type=int, default=10)
    parser.add_argument("--width", type=int, default=1000)
    parser.add_argument("--batch", type=int, default=64, help="global batch (8 devices)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    add_repeat_arg(parser)
    args = parser.parse_args()
    rounds = args.rounds or (8 if args.quick else 30)

    mesh = mesh_from_topology(Topology.create(len(jax.devices())))
    params = make_mlp(args.layers, args.width)
    rng = np.random.default_rng(1)
    batch = tuple(
        jax.device_put(
            jnp.asarray(rng.normal(size=(args.batch, args.width)), jnp.float32),
            NamedSharding(mesh, P("dp")),
        )
        for _ in range(2)
    )
    tx = optax.adam(1e-3)
    plan = plan_buckets(param_specs(params))
    bucketed_tx = optax.chain(synced("dp", plan=plan), tx)
    steps = {  # name -> (step, the transformation whose state it carries)
        "anchor (per-leaf pmean)": (anchor_step(tx, mesh), tx),
        "gradsync (default)": (data_parallel_step(loss_fn, tx, mesh), tx),
        f"gradsync bucketed ({len(plan.buckets)} buckets)": (
            data_parallel_step(loss_fn, bucketed_tx, mesh),
            bucketed_tx,
        ),
    }
    # Built once: the repeats reuse the compiled steps, and each starts from the same state.
    runs = run_repeats(lambda _: measure(args, rounds, params, batch, steps), args.repeat)
    finish(runs, ("ratio_vs_anchor", "bucketed_ratio_vs_anchor"))


def measure(args, rounds: int, params: dict, batch: tuple, steps: dict) -> dict:
    """One whole run (warm-up, alternating rounds, the agreement check) from the same state."""
    numel = sum(leaf.size for leaf in jax.tree.leaves(params))
    state = {name: (params, tx.init(params)) for name, (_, tx) in steps.items()}
    times: dict[str, list[float]] = {name: [] for name in steps}
    results = {}
    for r in range(args.warmup + rounds):
        for name, (step, _) in steps.items():
            p, s = state[name]
            t0 = time.perf_counter()
            p, s, loss = step(p, s, batch)
            jax.block_until_ready((p, s, loss))
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            state[name] = (p, s)
            results[name] = p
    # Same arithmetic up to the divide-before-sum: results agree to rounding.
    ref = jax.tree.leaves(results["anchor (per-leaf pmean)"])
    for name, p in results.items():
        pairs = zip(jax.tree.leaves(p), ref, strict=True)
        err = max(float(jnp.max(jnp.abs(a - b))) for a, b in pairs)
        if err > 1e-5:
            raise SystemExit(f"{name} diverged from the anchor by {err:.3g}")

    medians = {name: statistics.median(ts) for name, ts in times.items()}
    anchor = medians["anchor (per-leaf pmean)"]
    print(
        f"jax_dp: MLP {args.layers} x {args.width}^2 ({numel / 1e6:.1f}M params), "
        f"{len(jax.devices())} CPU devices, global batch {args.batch}, Adam, "
        f"{rounds} rounds after {args.warmup} warm-up, alternating"
    )
    print(f"{'variant':<34} {'median step (s)':>16} {'ratio vs anchor':>16}")
    for name, t in medians.items():
        print(f"{name:<34} {t:>16.4f} {t / anchor:>16.3f}")
    gradsync = medians["gradsync (default)"]
    bucketed = next(t for name, t in medians.items() if name.startswith("gradsync bucketed"))
    return {
        "bench": "jax_dp",
        "params": numel,
        "step_s": round(gradsync, 5),
        "anchor_step_s": round(anchor, 5),
        "ratio_vs_anchor": round(gradsync / anchor, 4),
        "bucketed_step_s": round(bucketed, 5),
        "bucketed_ratio_vs_anchor": round(bucketed / anchor, 4),
    }


if __name__ == "__main__":
    main()
