"""Sharded Optax optimizer (ZeRO) vs the unsharded Adam data-parallel step, 8 CPU devices.

Three jitted ``shard_map`` steps on the same ~10M-parameter MLP and the same batches, run
alternating in one process (docs/design.md §11), one step each per round:

- anchor: ``gradsync_jax.data_parallel_step`` with ``optax.adam`` (all-reduce, every device
  holds and updates the whole Adam state);
- greedy: ``shard_optimizer(optax.adam, partition="greedy")`` (whole tensors per device);
- flat: ``shard_optimizer(optax.adam, partition="flat")`` (element ranges of 25 MiB buckets);
- auto: ``shard_optimizer(optax.adam, partition="auto")``;
- jit: the JAX-native way, ``jax.jit`` of the plain step with the state sharded by
  ``NamedSharding`` (largest divisible axis over dp, else replicated): ``JitWay``.
  ``--optimizer adamw|masked_adamw`` replaces Adam everywhere (greedy/flat only where they
  accept it); ``auto_ratio_vs_jit`` is auto's paired ratio to the jit way.

Reported: median step time after warm-up, the median of the per-round ratios to the anchor
(target <= 1.10), and the optimizer-state bytes each device holds, measured from the arrays'
shards, against 1/N of the unsharded state (target <= 1/N + 5%). The gate: one step from the
same state matches the anchor (parameters to 1e-5, Adam moments to rtol 1e-4); how far the
runs drift apart after many steps is reported as a fraction of how far the parameters moved.
Last line: one JSON object.

    python benchmarks/jax_zero.py                  # 16 x 792^2 MLP (10.0M parameters)
    python benchmarks/jax_zero.py --quick          # fewer rounds, < 2 minutes on 2 cores
    python benchmarks/jax_zero.py --shape 96x512   # layers x width (the reference shapes: 16x792,
                                                   # 10x1000, 96x512, 24x1024, 6x1001)
    python benchmarks/jax_zero.py --shape all --quick  # the five reference shapes, one table
    JAX_PLATFORMS=cuda python benchmarks/jax_zero.py --shape all --batch 4096  # one GPU
    python benchmarks/jax_zero.py --repeat 5       # the whole run 5 times: median and range
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import add_repeat_arg, finish, run_repeats, summarize
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_dp import loss_fn, make_mlp  # the same ~10M-parameter MLP as benchmarks/jax_dp.py

from gradsync_core import Topology
from gradsync_jax import (
    data_parallel_step,
    mesh_from_topology,
    shard_optimizer,
    value_and_local_grad,
)


def sharded_step(tx, params: dict, mesh):
    """The training step a user writes with shard_optimizer (state specs from ``tx``)."""
    specs = tx.state_specs(params)

    def local(params, opt_state, batch):
        loss, grads = value_and_local_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, lax.pmean(loss, "dp")

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs, P())
    )
    return jax.jit(mapped)


class JitWay:
    """The JAX-native anchor (issue 26): ``jax.jit`` of the plain Optax step with the state
    placed by ``NamedSharding`` (each leaf's largest dimension divisible by N over dp,
    replicated otherwise, as MaxText and Levanter shard it) and XLA inserting the
    collectives. Quacks like a ``ShardedOptimizer`` where ``measure`` needs it."""

    def __init__(self, tx, mesh, params) -> None:
        n = mesh.shape["dp"]
        # Auto axes: jit's partitioner, not shard_map, decides where the collectives go.
        self.mesh = jax.make_mesh((n,), ("dp",), axis_types=(AxisType.Auto,))
        self.tx = tx

        def spec(leaf) -> P:
            dims = [d for d, size in enumerate(leaf.shape) if size % n == 0 and size >= n]
            if not dims:
                return P()
            best = max(dims, key=lambda d: leaf.shape[d])
            return P(*[("dp" if d == best else None) for d in range(len(leaf.shape))])

        shapes = jax.eval_shape(tx.init, params)
        self.shardings = jax.tree.map(lambda x: NamedSharding(self.mesh, spec(x)), shapes)
        self.replicated = NamedSharding(self.mesh, P())
        self.data = NamedSharding(self.mesh, P("dp"))

    def place(self, params):
        """``params`` replicated on this anchor's (Auto) mesh."""
        return jax.device_put(jax.tree.map(np.asarray, params), self.replicated)

    def init(self, params):
        return jax.jit(self.tx.init, out_shardings=self.shardings)(self.place(params))

    def step(self):
        def step(params, opt_state, batch):
            loss, grads = jax.value_and_grad(loss_fn)(params, batch)
            updates, opt_state = self.tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        jitted = jax.jit(step, out_shardings=(self.replicated, self.shardings, self.replicated))

        placed: dict = {}  # the batch moved to this mesh once, outside the timing loop

        def run(params, opt_state, batch):
            if id(batch) not in placed:
                placed[id(batch)] = (
                    batch,
                    jax.device_put(tuple(map(np.asarray, batch)), self.data),
                )
            return jitted(params, opt_state, placed[id(batch)][1])

        return run

    def gather_state(self, state, params):
        return state

    def plan(self, params):
        return None


def bytes_per_device(tree) -> int:
    """The most optimizer-state bytes any device holds, read from the arrays' shards."""
    held: dict = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


LABELS = {
    "anchor": "anchor (unsharded Adam DP)",
    "greedy": "shard_optimizer greedy",
    "flat": "shard_optimizer flat",
    "auto": "shard_optimizer auto",
    "jit": "jit + NamedSharding state",
}


# Issue 26's shapes: balanced (16 x 792^2), 10 equal tensors on 8 devices (greedy's
# imbalance 0.6), many small tensors (96 x 512^2), few large ones (24 x 1024^2), and an
# uneven one (6 x 1001^2: no dimension divisible by 8, so the jit way replicates it all).
ISSUE_SHAPES = ((16, 792), (10, 1000), (96, 512), (24, 1024), (6, 1001))


def parse_shape(text: str) -> tuple[tuple[int, int], ...]:
    """``"16x792"`` -> ((16, 792),): layers x width of the square Dense layers; several
    separated by commas; ``"all"``: the five reference shapes (docs/jax-zero.md)."""
    if text.lower() == "all":
        return ISSUE_SHAPES
    try:
        return tuple(
            (int(layers), int(width))
            for layers, width in (part.lower().split("x") for part in text.split(","))
        )
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--shape wants LAYERSxWIDTH such as 16x792 (several: 16x792,10x1000) or 'all', "
            f"got {text!r}"
        ) from None


def sharded_optimizers(adam, mesh, params, partitions=("greedy", "flat", "auto")) -> dict:
    """``partitions`` (where they accept the optimizer) and the jit anchor."""
    txs = {}
    for p in partitions:
        try:
            txs[p] = shard_optimizer(adam, mesh, partition=p)
            txs[p].layout(params)
        except ValueError:  # a partition that cannot run this optimizer exactly
            txs.pop(p, None)
    txs["jit"] = JitWay(adam, mesh, params)
    return txs


OPTIMIZERS = {
    "adam": lambda: optax.adam(1e-3),
    "adamw": lambda: optax.adamw(1e-3, weight_decay=1e-2),
    # The usual no-decay-on-biases mask (by rank).
    "masked_adamw": lambda: optax.adamw(
        1e-3, weight_decay=1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
    ),
}


def chosen_partition(tx, params) -> str:
    """``"flat"``, ``"flat/param"`` (one bucket per parameter), ``"greedy"`` or
    ``"gathered"``: the layout ``tx`` (``auto`` included) uses for ``params``."""
    layout = tx.layout(params)
    name = type(layout).__name__.removesuffix("Layout").lower()
    return f"{name}/param" if getattr(layout, "by_param", False) else name


def describe_plan(name: str, plan) -> str:
    """One phrase per plan, from whichever of the known figures the plan has."""
    parts = []
    if getattr(plan, "imbalance", None) is not None:
        parts.append(f"imbalance {plan.imbalance:.4f} (max/mean load - 1)")
    if getattr(plan, "buckets", None) is not None:
        parts.append(f"{len(plan.buckets.buckets)} buckets")
    if getattr(plan, "padding_numel", None) is not None:
        parts.append(f"{plan.padding_numel} padding elements")
    return f"{name} plan: " + (", ".join(parts) or type(plan).__name__)


def largest_difference(xs, ys) -> float:
    # On the host: the jit anchor's arrays live on another mesh than the others.
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b)))) for a, b in zip(xs, ys, strict=True)
    )


def first_step_error(state: dict, steps: dict, batch, txs: dict) -> float:
    """The largest parameter difference to the anchor after one step from the same state.

    The gate of the run: parameters within 1e-5, and the sharded Adam moments gathered back
    equal to the anchor's (rtol 1e-4), not only the parameters (docs/design.md §7)."""
    ref_params, ref_state, _ = steps["anchor"](*state["anchor"], batch)
    ref = jax.tree.leaves(ref_params)
    err = 0.0
    for name, tx in txs.items():
        new_params, new_state, _ = steps[name](*state[name], batch)
        err = max(err, largest_difference(jax.tree.leaves(new_params), ref))
        gathered = jax.tree.leaves(tx.gather_state(new_state, state[name][0]))
        for a, b in zip(gathered, jax.tree.leaves(ref_state), strict=True):
            if not np.allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-12):
                raise SystemExit(f"{name}: one step's optimizer state differs from the anchor's")
    if err > 1e-5:
        raise SystemExit(f"one step from the same state differs from the anchor by {err:.3g}")
    return err


def measure(args, mesh, params, batch, adam, txs, steps) -> dict:
    """One whole run (warm-up, alternating rounds, checks) from the initial state."""
    replicated = NamedSharding(mesh, P())
    n = mesh.shape["dp"]
    state = {"anchor": (params, jax.device_put(adam.init(params), replicated))}
    for partition, tx in txs.items():
        start = tx.place(params) if isinstance(tx, JitWay) else params
        state[partition] = (start, tx.init(params))
    state_bytes = {name: bytes_per_device(s) for name, (_, s) in state.items()}
    step_error = first_step_error(state, steps, batch, txs)

    times: dict[str, list[float]] = {name: [] for name in steps}
    for r in range(args.warmup + args.rounds):
        for name, step in steps.items():
            p, s = state[name]
            t0 = time.perf_counter()
            p, s, loss = step(p, s, batch)
            jax.block_until_ready((p, s, loss))
            if r >= args.warmup:
                times[name].append(time.perf_counter() - t0)
            state[name] = (p, s)
    # The gate is first_step_error (one step from the same state, exact to 1e-5). After many
    # steps the runs drift apart: the all-reduce and the reduce-scatter sum in different
    # orders, and on a deep tanh MLP (96 x 512^2) Adam turns the rounding of near-zero
    # gradients into whole steps (measured: as much as the parameters moved, even on one GPU,
    # where only XLA's fusion differs). The drift is reported, not gated.
    anchor_params = jax.tree.leaves(state["anchor"][0])
    moved = largest_difference(anchor_params, jax.tree.leaves(params))
    drift = {
        name: largest_difference(jax.tree.leaves(state[name][0]), anchor_params) / max(moved, 1e-30)
        for name in txs
    }
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    # Paired ratios: each round's step against the anchor's step of the same round, so a
    # load change on the (shared) machine moves both; the figure is their median.
    ratios = {
        name: statistics.median(t / a for t, a in zip(ts, times["anchor"], strict=True))
        for name, ts in times.items()
    }
    unsharded = state_bytes["anchor"]
    ideal = unsharded / n
    numel = sum(leaf.size for leaf in jax.tree.leaves(params))
    print(
        f"jax_zero: MLP {args.layers} x {args.width}^2 ({numel / 1e6:.1f}M params), {n} "
        f"{jax.devices()[0].platform.upper()} devices, global batch {args.batch}, "
        f"{args.optimizer}, {args.rounds} rounds after {args.warmup} warm-up, alternating"
    )
    print(
        f"{'variant':<28} {'median step (s)':>15} {'vs anchor':>10} "
        f"{'state MB/device':>16} {'vs 1/N':>8}"
    )
    for name, t in medians.items():
        print(
            f"{LABELS[name]:<28} {t:>15.4f} {ratios[name]:>10.3f} "
            f"{state_bytes[name] / 2**20:>16.2f} {state_bytes[name] / ideal:>8.3f}"
        )
    sharded = {name: tx for name, tx in txs.items() if not isinstance(tx, JitWay)}
    plans = {name: tx.plan(params) for name, tx in sharded.items()}
    chosen = {name: chosen_partition(tx, params) for name, tx in sharded.items()}
    for name, plan in plans.items():
        print(describe_plan(f"{name} ({chosen[name]})", plan))
    figures = {"bench": "jax_zero", "params": numel, "devices": n}
    figures["shape"] = f"{args.layers}x{args.width}"
    figures["partitions"] = list(txs)
    figures["anchor_step_s"] = round(medians["anchor"], 5)
    figures["state_bytes_unsharded"] = unsharded
    for name in txs:
        figures[f"{name}_step_s"] = round(medians[name], 5)
        figures[f"{name}_ratio_vs_anchor"] = round(ratios[name], 4)
        figures[f"{name}_drift_vs_moved"] = round(drift[name], 4)
        figures[f"{name}_state_bytes_per_device"] = state_bytes[name]
        figures[f"{name}_state_vs_ideal"] = round(state_bytes[name] / ideal, 4)
    figures["auto_partition"] = chosen.get("auto")
    figures["first_step_max_abs_error"] = step_error
    figures["optimizer"] = args.optimizer
    if "auto" in times and "jit" in times:  # the target: auto <= 1.00x the jit anchor
        figures["auto_ratio_vs_jit"] = round(
            statistics.median(a / j for a, j in zip(times["auto"], times["jit"], strict=True)), 4
        )
        print(
            f"auto vs jit + NamedSharding (median of paired ratios): "
            f"{figures['auto_ratio_vs_jit']:.3f}x"
        )
    figures["greedy_imbalance"] = round(plans["greedy"].imbalance, 5) if "greedy" in plans else None
    figures["flat_padding_numel"] = plans["flat"].padding_numel if "flat" in plans else None
    first = next(iter(sharded))  # the first partition run (greedy by default)
    figures["step_s"] = figures[f"{first}_step_s"]
    figures["ratio_vs_anchor"] = figures[f"{first}_ratio_vs_anchor"]
    return figures


def run_shape(args, layers: int, width: int) -> list[dict]:
    """Every repeat of the measurement on one ``layers x width^2`` MLP."""
    args.layers, args.width = layers, width
    mesh = mesh_from_topology(Topology.create(len(jax.devices())))
    replicated = NamedSharding(mesh, P())
    params = jax.device_put(make_mlp(layers, width), replicated)
    rng = np.random.default_rng(1)
    batch = tuple(
        jax.device_put(
            jnp.asarray(rng.normal(size=(args.batch, width)), jnp.float32),
            NamedSharding(mesh, P("dp")),
        )
        for _ in range(2)
    )
    adam = OPTIMIZERS[args.optimizer]()
    txs = sharded_optimizers(adam, mesh, params, args.partitions)
    # Built once: the repeats reuse the compiled steps, and each starts from the same state.
    steps = {"anchor": data_parallel_step(loss_fn, adam, mesh)}
    for partition, tx in txs.items():
        steps[partition] = tx.step() if isinstance(tx, JitWay) else sharded_step(tx, params, mesh)
    return run_repeats(lambda _: measure(args, mesh, params, batch, adam, txs, steps), args.repeat)


def print_summary(results: dict[str, dict]) -> None:
    """One line per shape: each variant's step time vs the anchor and its state vs 1/N."""
    names = [
        n
        for n in ("greedy", "flat", "auto", "jit")
        if any(f"{n}_step_s" in r for r in results.values())
    ]
    print("\nsummary: step time vs unsharded Adam (median of paired ratios), state vs 1/N")
    head = f"{'shape':<10} {'anchor (s)':>10}" + "".join(
        f" {n + ' step':>12} {n + ' state':>12}" for n in names
    )
    print(head + f" {'auto vs jit [range]':>22} {'auto uses':>11}")
    for shape, r in results.items():
        cells = "".join(
            f" {r[f'{n}_ratio_median']:>11.3f}x {r[f'{n}_state_vs_ideal']:>11.3f}x" for n in names
        )
        vs_jit = (
            f"{r['auto_ratio_vs_jit_median']:.3f}x [{r['auto_ratio_vs_jit_min']:.2f}-"
            f"{r['auto_ratio_vs_jit_max']:.2f}]"
            if "auto_ratio_vs_jit_median" in r
            else "-"
        )
        print(
            f"{shape:<10} {r['anchor_step_s']:>10.4f}{cells} {vs_jit:>22} "
            f"{r.get('auto_partition')!s:>11}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 2 minutes)")
    parser.add_argument(
        "--shape",
        type=parse_shape,
        help="LAYERSxWIDTH, e.g. 16x792, or 'all': the five reference shapes "
        "(overrides the next two)",
    )
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=792)
    parser.add_argument("--batch", type=int, default=64, help="global batch (8 devices)")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    parser.add_argument(
        "--partitions",
        type=lambda text: tuple(text.split(",")),
        default=("greedy", "flat", "auto"),
        help="the shard_optimizer partitions to run beside the two anchors (comma-separated; "
        "default greedy,flat,auto)",
    )
    add_repeat_arg(parser)
    args = parser.parse_args()
    shapes = args.shape or ((args.layers, args.width),)
    args.rounds = args.rounds or (6 if args.quick else 25)
    ratio_keys = ["ratio_vs_anchor", "auto_ratio_vs_jit"] + [
        f"{n}_ratio_vs_anchor" for n in ("greedy", "flat", "auto", "jit")
    ]
    if len(shapes) == 1:
        runs = run_shape(args, *shapes[0])
        finish(runs, [k for k in ratio_keys if k in runs[0]])
        return
    results = {}
    for layers, width in shapes:
        runs = run_shape(args, layers, width)
        results[f"{layers}x{width}"] = summarize(runs, [k for k in ratio_keys if k in runs[0]])
        jax.clear_caches()  # the last shape's compiled steps: 5 shapes at once ran out of memory
        gc.collect()
    print_summary(results)
    print(json.dumps({"bench": "jax_zero", "shapes": results}), flush=True)


if __name__ == "__main__":
    main()
