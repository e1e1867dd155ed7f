"""Sharded parameters on 8 CPU devices: gradsync ZeRO-3 vs the GSPMD way a JAX user would pick.

Three jitted AdamW steps on the same MLP and the same batches, run alternating in one process
(docs/design.md §11), one step each per round:

- replicated: parameters and Adam state replicated, batch split over ``dp``, ``jit`` with
  in/out shardings (XLA's data parallelism; nothing sharded but the batch);
- gspmd: the MaxText way: every parameter and state leaf a ``NamedSharding`` with ``dp`` on
  its largest dimension the axis divides (replicated if none does), ``jit`` with in/out
  shardings, XLA inserting the collectives;
- zero3: ``gradsync_jax.zero3_step`` (one unit per layer, ``reshard_after_forward=True``).

Reported per shape: median step time and its ratio to gspmd (median of the per-round
ratios), and bytes per device: parameters + optimizer state held (read from the arrays'
shards) and the compiled program's temporary bytes (``compiled.memory_analysis()``). The gate:
after one step from the same state, zero3's and gspmd's parameters differ from the replicated
run's by less than 10 % of how far that step moved them (``*_first_step_error``).
Last line: one JSON object.

    python benchmarks/jax_fsdp.py --repeat 3            # 16x792, 10x1000, 96x512, 24x1024
    python benchmarks/jax_fsdp.py --shape 16x792 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
from _report import add_repeat_arg, run_repeats, summarize
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_dp import loss_fn, make_mlp  # the MLP of benchmarks/jax_dp.py and jax_zero.py
from jax_zero import bytes_per_device, parse_shape

from gradsync_jax import param_layout, shard_params, unshard_params, zero3_step

SHAPES = ((16, 792), (10, 1000), (96, 512), (24, 1024))
VARIANTS = ("replicated", "gspmd", "zero3")


def gspmd_spec(shape: tuple[int, ...], n: int) -> P:
    """``dp`` on the largest dimension ``n`` divides (the first of equals), else replicated."""
    dims = [i for i, d in enumerate(shape) if d % n == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*[("dp" if i == best else None) for i in range(len(shape))])


def jit_step(tx, params, opt_state, mesh, spec_of):
    """A jitted step whose parameters and state are placed by ``spec_of(shape)``."""

    def shardings(tree):
        return jax.tree.map(lambda x: NamedSharding(mesh, spec_of(np.shape(x))), tree)

    p_sh, s_sh = shardings(params), shardings(opt_state)
    batch_sh = NamedSharding(mesh, P("dp"))

    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    fn = jax.jit(
        step,
        in_shardings=(p_sh, s_sh, (batch_sh, batch_sh)),
        out_shardings=(p_sh, s_sh, NamedSharding(mesh, P())),
        donate_argnums=(0, 1),
    )
    return fn, jax.device_put(params, p_sh), jax.device_put(opt_state, s_sh)


def build(layers: int, width: int, mesh: Mesh, tx) -> dict:
    """Each variant's (step, lowered, params, state)."""
    n = mesh.shape["dp"]
    params = make_mlp(layers, width)
    out = {}
    for name, spec_of in (("replicated", lambda s: P()), ("gspmd", lambda s: gspmd_spec(s, n))):
        fn, p, s = jit_step(tx, params, tx.init(params), mesh, spec_of)
        out[name] = [fn, fn, p, s]
    layout = param_layout(params, world_size=n, units=[f"layer_{i}" for i in range(layers)])
    z = zero3_step(loss_fn, tx, mesh, layout, donate=True)
    sharded = shard_params(params, mesh, layout)
    out["zero3"] = [z, z, sharded, z.init(sharded)]
    out["zero3"].append(layout)
    return out


def largest(a, b) -> float:
    """The largest absolute difference between two trees of arrays."""
    pairs = zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
    return max(float(np.max(np.abs(x - y))) for x, y in pairs)


def compiled_temp_bytes(lowerable, params, state, batch) -> int:
    stats = lowerable.lower(params, state, batch).compile().memory_analysis()
    return int(getattr(stats, "temp_size_in_bytes", -1)) if stats is not None else -1


def measure(args, layers: int, width: int, mesh: Mesh) -> dict:
    tx = optax.adamw(1e-3)
    variants = build(layers, width, mesh, tx)
    rng = np.random.default_rng(0)
    batch = tuple(
        jax.device_put(
            rng.normal(size=(args.batch, width)).astype(np.float32), NamedSharding(mesh, P("dp"))
        )
        for _ in range(2)
    )
    figures: dict = {"shape": f"{layers}x{width}", "params": layers * (width * width + width)}
    for name, v in variants.items():
        figures[f"{name}_held_bytes"] = bytes_per_device([v[2], v[3]])
        figures[f"{name}_temp_bytes"] = compiled_temp_bytes(v[1], v[2], v[3], batch)
    # The gate: one step from the same state, parameters compared with the replicated run,
    # relative to how far that step moved them. Adam's first update is g / (|g| + eps), so a
    # gradient near zero turns the last-bit differences of another summation order into
    # updates of a few % of the learning rate (GSPMD measures 1.4 % on 16x792); a wrong
    # gradient or a misplaced row moves them by the whole step.
    start = jax.tree.map(np.asarray, variants["replicated"][2])
    first = {}
    for name, v in variants.items():
        v[2], v[3], _ = v[0](v[2], v[3], batch)
        first[name] = (
            unshard_params(v[2], v[4]) if name == "zero3" else jax.tree.map(np.asarray, v[2])
        )
    moved = largest(first["replicated"], start)
    for name in ("gspmd", "zero3"):
        err = largest(first[name], first["replicated"]) / moved
        figures[f"{name}_first_step_error"] = err
        assert err < 0.1, f"{name} differs from the replicated step by {err:.3f} of the step"
    times = {name: [] for name in variants}
    for _ in range(args.warmup + args.rounds):
        for name, v in variants.items():
            start = time.perf_counter()
            v[2], v[3], loss = v[0](v[2], v[3], batch)
            jax.block_until_ready((v[2], v[3], loss))
            times[name].append(time.perf_counter() - start)
    for name in variants:
        figures[f"{name}_step_s"] = statistics.median(times[name][args.warmup :])
    for name in ("replicated", "zero3"):
        mine, anchor = times[name][args.warmup :], times["gspmd"][args.warmup :]
        ratios = [a / b for a, b in zip(mine, anchor, strict=True)]
        figures[f"{name}_ratio_vs_anchor"] = statistics.median(ratios)
    print_row(figures)
    return figures


def print_row(f: dict) -> None:
    mib = 1 << 20
    print(
        f"{f['shape']:>8} {f['params'] / 1e6:5.1f}M | "
        + " | ".join(
            f"{name} {f[f'{name}_step_s'] * 1e3:7.1f} ms "
            f"held {f[f'{name}_held_bytes'] / mib:6.1f} MiB "
            f"temp {f[f'{name}_temp_bytes'] / mib:6.1f} MiB"
            for name in VARIANTS
        )
        + f" | zero3/gspmd {f['zero3_ratio_vs_anchor']:.3f}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=parse_shape, default=SHAPES, help="e.g. 16x792,96x512")
    parser.add_argument("--batch", type=int, default=256, help="global batch (rows)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    add_repeat_arg(parser)
    args = parser.parse_args()
    mesh = Mesh(np.array(jax.devices()[:8]), ("dp",))
    ratio_keys = ("replicated_ratio_vs_anchor", "zero3_ratio_vs_anchor")
    results = {}
    for layers, width in args.shape:
        runs = run_repeats(lambda _, s=(layers, width): measure(args, *s, mesh), args.repeat)
        results[f"{layers}x{width}"] = summarize(runs, ratio_keys, ("zero3_first_step_error",))
    print("median over repeats (zero3 / gspmd step time; bytes per device, MiB):")
    for key, r in results.items():
        print(
            f"  {key:>8}: zero3/gspmd {r['zero3_ratio_median']:.3f} "
            f"[{r['zero3_ratio_min']:.3f}-{r['zero3_ratio_max']:.3f}], replicated/gspmd "
            f"{r['replicated_ratio_median']:.3f}; held zero3 {r['zero3_held_bytes'] / 2**20:.1f} "
            f"gspmd {r['gspmd_held_bytes'] / 2**20:.1f} replicated "
            f"{r['replicated_held_bytes'] / 2**20:.1f}; temp zero3 "
            f"{r['zero3_temp_bytes'] / 2**20:.1f} gspmd {r['gspmd_temp_bytes'] / 2**20:.1f}"
        )
    print(json.dumps({"bench": "jax_fsdp", "shapes": results}), flush=True)


if __name__ == "__main__":
    main()
