"""Sharded parameters on 8 CPU devices: gradsync ZeRO-3 vs the GSPMD way a JAX user would pick.

Three jitted AdamW steps on the same MLP and the same batches, run alternating in one process
(docs/design.md §11), one step each per round:

- replicated: parameters and Adam state replicated, batch split over ``dp``, ``jit`` with
  in/out shardings (XLA's data parallelism; nothing sharded but the batch);
- gspmd: the MaxText way: every parameter and state leaf a ``NamedSharding`` with ``dp`` on
  its largest dimension the axis divides (replicated if none does), ``jit`` with in/out
  shardings, XLA inserting the collectives;
- zero3: ``gradsync_jax.zero3_step`` (one unit per layer, ``reshard_after_forward=True``).

Workloads: the MLPs of benchmarks/jax_dp.py (``--shape``) and a small decoder-only
transformer (``--transformer LxD``: L pre-norm blocks of width D, 4 heads, vocabulary 4·D with
the embedding tied to the output head, sequences of 64 tokens, batch ``--batch / 8``
sequences; ``--transformer none`` leaves it out).

Reported per shape: median step time and its ratio to gspmd (median of the per-round
ratios), and bytes per device: parameters + optimizer state held (read from the arrays'
shards) and the compiled program's temporary bytes (``compiled.memory_analysis()``).
``--memory-scheduler`` compiles every variant with XLA:CPU's memory-minimizing scheduler
(docs/jax-zero3.md, "Where the temporary bytes go"). The gate
(``first_step_gate``): after one step from the same state, zero3's and gspmd's Adam moments
(the gradient and its square) equal the replicated run's to 1e-4 of each leaf's largest
(``*_moment_error``), and their parameters, where the gradient is clear of rounding, differ by
less than 1 % of how far the step moved them (``*_first_step_error``).
Last line: one JSON object.

    python benchmarks/jax_fsdp.py --repeat 3    # 16x792, 10x1000, 96x512, 24x1024, tfm 4x256
    python benchmarks/jax_fsdp.py --shape 16x792 --rounds 3
    python benchmarks/jax_fsdp.py --quick       # every row, 2 rounds: a smoke run of the gates
    python benchmarks/jax_fsdp.py --memory-scheduler --repeat 3   # the second table of the docs
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any, NamedTuple

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# --memory-scheduler: XLA:CPU's memory-minimizing scheduler for every variant (a process-wide
# flag: jit's compiler_options does not reach the scheduler choice), set before jax starts.
os.environ["XLA_FLAGS"] += " --xla_cpu_enable_concurrency_optimized_scheduler=false" * (
    "--memory-scheduler" in sys.argv
)

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import add_repeat_arg, run_repeats, summarize
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax_dp import loss_fn as mlp_loss
from jax_dp import make_mlp  # the MLP of benchmarks/jax_dp.py and jax_zero.py
from jax_zero import bytes_per_device, parse_shape

from gradsync_jax import param_layout, shard_params, unshard_params, zero3_step

MEMORY_SCHEDULER = "--memory-scheduler" in sys.argv
SHAPES = ((16, 792), (10, 1000), (96, 512), (24, 1024))
VARIANTS = ("replicated", "gspmd", "zero3")


def gspmd_spec(shape: tuple[int, ...], n: int) -> P:
    """``dp`` on the largest dimension ``n`` divides (the first of equals), else replicated."""
    dims = [i for i, d in enumerate(shape) if d % n == 0]
    if not dims:
        return P()
    best = max(dims, key=lambda i: (shape[i], -i))
    return P(*[("dp" if i == best else None) for i in range(len(shape))])


class Workload(NamedTuple):
    """A model to step: its parameters, loss, units and a global batch (host arrays)."""

    name: str
    params: Any
    loss_fn: Any
    units: list[str]
    batch: tuple[np.ndarray, np.ndarray]


def mlp(layers: int, width: int, batch: int) -> Workload:
    rng = np.random.default_rng(0)
    data = tuple(rng.normal(size=(batch, width)).astype(np.float32) for _ in range(2))
    units = [f"layer_{i}" for i in range(layers)]
    return Workload(f"{layers}x{width}", make_mlp(layers, width), mlp_loss, units, data)


SEQ, HEADS = 64, 4


def _norm(x: jax.Array, scale: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6) * scale


def transformer_loss(params: dict, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Next-token cross entropy of a pre-norm decoder, the embedding tied to the head."""
    tokens, labels = batch
    table = params["embed"]["embedding"]
    x = table[tokens]
    b, s, d = x.shape
    mask = jnp.tril(jnp.ones((s, s), bool))
    for i in range(len(params) - 1):
        p = params[f"layer_{i}"]
        h = _norm(x, p["norm_1"]["scale"])
        q, k, v = jnp.split(h @ p["qkv"]["kernel"], 3, axis=-1)
        q, k, v = (t.reshape(b, s, HEADS, d // HEADS) for t in (q, k, v))
        att = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(d // HEADS)
        att = jax.nn.softmax(jnp.where(mask, att, -1e9), axis=-1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", att, v).reshape(b, s, d) @ p["out"]["kernel"]
        h = _norm(x, p["norm_2"]["scale"])
        x = x + jax.nn.gelu(h @ p["up"]["kernel"]) @ p["down"]["kernel"]
    logits = x @ table.T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def transformer(layers: int, width: int, batch: int) -> Workload:
    rng = np.random.default_rng(0)
    vocab, scale = 4 * width, 1.0 / np.sqrt(width)

    def dense(a: int, b: int) -> dict:
        return {"kernel": jnp.asarray(rng.normal(0, scale, (a, b)), jnp.float32)}

    params: dict = {"embed": {"embedding": jnp.asarray(rng.normal(0, 1, (vocab, width)), "f4")}}
    for i in range(layers):
        params[f"layer_{i}"] = {
            "norm_1": {"scale": jnp.ones((width,), jnp.float32)},
            "qkv": dense(width, 3 * width),
            "out": dense(width, width),
            "norm_2": {"scale": jnp.ones((width,), jnp.float32)},
            "up": dense(width, 4 * width),
            "down": dense(4 * width, width),
        }
    sequences = max(8, batch // 8)
    tokens = rng.integers(0, vocab, (sequences, SEQ + 1)).astype(np.int32)
    units = [f"layer_{i}" for i in range(layers)]
    name = f"tfm{layers}x{width}"
    return Workload(name, params, transformer_loss, units, (tokens[:, :-1], tokens[:, 1:]))


def jit_step(tx, params, opt_state, mesh, spec_of, loss_fn):
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


def build(work: Workload, mesh: Mesh, tx) -> dict:
    """Each variant's (step, lowered, params, state)."""
    n = mesh.shape["dp"]
    params = work.params
    out = {}
    for name, spec_of in (("replicated", lambda s: P()), ("gspmd", lambda s: gspmd_spec(s, n))):
        fn, p, s = jit_step(tx, params, tx.init(params), mesh, spec_of, work.loss_fn)
        out[name] = [fn, fn, p, s]
    layout = param_layout(params, world_size=n, units=work.units)
    z = zero3_step(work.loss_fn, tx, mesh, layout, donate=True)
    sharded = shard_params(params, mesh, layout)
    out["zero3"] = [z, z, sharded, z.init(sharded)]
    out["zero3"].append(layout)
    return out


# The first-step gate's bounds (see ``first_step_gate``).
MOMENT_RTOL = 1e-4  # of the leaf's largest moment
STEP_RTOL = 0.01  # of the largest move, on the elements whose gradient is well above rounding
CLEAR_GRADIENT = 1e-3  # of the leaf's largest gradient: Adam's step is stable above it
GATE_KEYS = tuple(
    f"{v}_{k}" for v in ("gspmd", "zero3") for k in ("moment_error", "first_step_error")
)


def first_step_gate(start, first: dict) -> dict:
    """Compare each variant's first step (parameters, Adam's mu and nu, whole Flax-layout
    host arrays) with the replicated run's, from the same start, leaf by leaf.

    Adam's first update is ``g / (|g| + eps)``: where a gradient is near zero (a token absent
    from the batch, a saturated unit) the last bits of another summation order decide its sign,
    and the parameter moves by a whole learning rate either way (measured on the transformer:
    0.37 of the step on an element whose gradient was 2.7e-8, the gradients themselves equal to
    3e-7 of each leaf's largest). So the parameters alone cannot gate, and since that update is
    scale-free, a gradient off by a constant factor would not move them at all. The gate is:

    - ``moment_error``: the moments after one step are the gradient (``mu = (1 - b1) g``) and
      its square (``nu``); per leaf, the largest difference over the leaf's largest value,
      below ``MOMENT_RTOL``. A wrong scale, a misplaced row or a missing reduction shows here.
    - ``first_step_error``: the parameters, on the elements whose gradient is above
      ``CLEAR_GRADIENT`` of the leaf's largest, differ by less than ``STEP_RTOL`` of how far
      the step moved them. This catches an update applied to the wrong rows or not at all.
    """
    params0, (ref_p, ref_mu, ref_nu) = jax.tree.leaves(start), first["replicated"]
    moved = max(float(np.max(np.abs(a - b))) for a, b in zip(ref_p, params0, strict=True))
    figures = {}
    for name in first.keys() - {"replicated"}:
        p, mu, nu = first[name]
        moments = max(
            float(np.max(np.abs(a - b))) / max(float(np.max(np.abs(b))), 1e-30)
            for a, b in zip(mu + nu, ref_mu + ref_nu, strict=True)
        )
        step = (
            max(
                float(
                    np.max(
                        np.abs(a - b),
                        where=np.abs(g) > CLEAR_GRADIENT * np.max(np.abs(g)),
                        initial=0.0,
                    )
                )
                for a, b, g in zip(p, ref_p, ref_mu, strict=True)
            )
            / moved
        )
        figures[f"{name}_moment_error"], figures[f"{name}_first_step_error"] = moments, step
        assert moments < MOMENT_RTOL, (
            f"{name}: Adam's moments after one step differ by {moments:.3g}"
        )
        assert step < STEP_RTOL, f"{name}: one step's parameters differ by {step:.3g} of the step"
    return figures


def first_step(variant: list, batch, zero3: bool) -> tuple[list, list, list]:
    """One step of ``variant`` (stepping it): parameters, Adam's mu and nu as whole host
    leaves in Flax's layout."""
    variant[2], variant[3], _ = variant[0](variant[2], variant[3], batch)
    adam = variant[3][0]  # optax.adamw's chain: scale_by_adam's state first
    trees = (variant[2], adam.mu, adam.nu)
    if zero3:
        trees = tuple(unshard_params(t, variant[4]) for t in trees)
    return tuple([np.asarray(x) for x in jax.tree.leaves(t)] for t in trees)


def compiled_temp_bytes(lowerable, params, state, batch) -> int:
    stats = lowerable.lower(params, state, batch).compile().memory_analysis()
    return int(getattr(stats, "temp_size_in_bytes", -1)) if stats is not None else -1


def measure(args, work: Workload, mesh: Mesh) -> dict:
    tx = optax.adamw(1e-3)
    variants = build(work, mesh, tx)
    batch = tuple(jax.device_put(a, NamedSharding(mesh, P("dp"))) for a in work.batch)
    count = sum(int(np.size(x)) for x in jax.tree.leaves(work.params))
    figures: dict = {"shape": work.name, "params": count}
    for name, v in variants.items():
        figures[f"{name}_held_bytes"] = bytes_per_device([v[2], v[3]])
        figures[f"{name}_temp_bytes"] = compiled_temp_bytes(v[1], v[2], v[3], batch)
    start = jax.tree.map(np.asarray, variants["replicated"][2])
    first = {name: first_step(v, batch, name == "zero3") for name, v in variants.items()}
    figures.update(first_step_gate(start, first))
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
        + f" | zero3/gspmd {f['zero3_ratio_vs_anchor']:.3f} | gate zero3 moments "
        f"{f['zero3_moment_error']:.1e} step {f['zero3_first_step_error']:.1e}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", type=parse_shape, default=SHAPES, help="e.g. 16x792,96x512")
    parser.add_argument("--batch", type=int, default=256, help="global batch (rows)")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 5)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed rounds (default 2)")
    parser.add_argument("--quick", action="store_true", help="2 rounds, 1 warm-up: a smoke run")
    parser.add_argument(
        "--memory-scheduler",
        action="store_true",
        help="XLA:CPU's memory-minimizing scheduler for every variant",
    )
    parser.add_argument("--transformer", default="4x256", help="LxD, or none")
    add_repeat_arg(parser)
    args = parser.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.warmup = 1 if args.quick and args.warmup is None else (args.warmup or 2)
    mesh = Mesh(np.array(jax.devices()[:8]), ("dp",))
    ratio_keys = ("replicated_ratio_vs_anchor", "zero3_ratio_vs_anchor")
    works = [mlp(layers, width, args.batch) for layers, width in args.shape]
    if args.transformer != "none":
        works.append(transformer(*parse_shape(args.transformer)[0], args.batch))
    results = {}
    for work in works:
        runs = run_repeats(lambda _, w=work: measure(args, w, mesh), args.repeat)
        results[work.name] = summarize(runs, ratio_keys, GATE_KEYS)
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
    summary = {"bench": "jax_fsdp", "memory_scheduler": MEMORY_SCHEDULER, "shapes": results}
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
