"""Every parallelism at once: gradsync's composition against torch's own and against GSPMD.

The Llama reference (examples/llama_config.py; ``gradsync plan``'s built-in
``llama-nd-bench``: 4 layers of width 256, 4 heads, 2 kv heads, SwiGLU 768, vocabulary 2048,
4.2 M parameters), float32, AdamW with weight decay, the gradients clipped by the whole
model's 2-norm. Each side runs in the same process tree as its anchor, alternating step by
step on the same weights and the same batches (docs/design.md §11); a step time is the median
over the timed rounds (torch: of the slowest rank's step).

Torch, 8 gloo ranks (benchmarks/_nd_parallel_torch.py): ``examples/llama_torch.parallelize``
against torch's composition as torchtitan builds it (FSDP2 ``fully_shard`` + DTensor
``parallelize_module`` tensor and sequence parallelism + ``torch.distributed.pipelining``),
with the same FSDP units, ``reshard_after_forward``, stages, schedule and microbatches:

    dp_shard 2 x tp 2 x pp 2             1F1B, 4 microbatches
    dp_replicate 2 x dp_shard 2 x tp 2   HSDP with tensor parallelism

JAX, 8 CPU devices (benchmarks/_nd_parallel_jax.py, a process of its own):
``examples/llama_nnx.parallelize`` against the JAX-native way, the same NNX model placed by
``NamedSharding`` on a ``(dp, tp)`` mesh with its Megatron specs under ``jax.jit``:

    dp 4 x tp 2          parameters replicated over dp
    dp_shard 4 x tp 2    parameters also sharded over dp (GSPMD: "dp" on their other dim)

Correctness first: both sides of each row start from the same weights, and the loss of every
step (the last after all but one update) must agree within ``LOSS_RTOL``; every row also
reports the largest difference between the two sides' weights after the last step (not gated:
in float32 Adam turns the reduction order's last bits on near-zero gradients into ~1e-5).

Memory per rank, beside what ``gradsync plan --model llama-nd-bench ... --zero 3 --optimizer
adamw --batch B --seq S`` predicts for the rank's pipeline stage (parameters, gradients,
AdamW state, FSDP's gathered units, and the activations the executor's program saves for the
microbatches the rank stashes at its peak: one, its whole batch, without a pipeline; the
schedule's peak stash with one, ``--schedule --microbatches``):

- torch: "held" is the parameters, gradients (after a backward) and AdamW state, each storage
  counted once (torch_fsdp.py's measure); "peak" is the parameters and state plus the largest
  rise of live CPU bytes during one more step (torch's profiler), activations included.
- JAX: "held" is the parameters and Adam state a device holds between steps (JAX keeps no
  gradients); "peak" is XLA's accounting of the compiled step (``memory_analysis``: its
  arguments, plus the outputs that do not reuse the donated arguments, plus its temporary
  bytes: gradients, gathered parameters, activations), against the prediction of
  ``--executor jax``: one sequence-parallel gather per attention and MLP, and the stage's
  ``dp_shard`` gathers kept from the forward to the backward.

    python benchmarks/nd_parallel.py --repeat 3
    python benchmarks/nd_parallel.py --quick        # 1 warm-up and 2 timed steps
    python benchmarks/nd_parallel.py --only jax     # the JAX rows alone (or --only torch)
    python benchmarks/nd_parallel.py --row jax_fsdp_tp   # one row alone (repeatable)

The last line is one JSON object: {"bench": "nd_parallel", "ratio_vs_anchor": the median over
the torch rows of gradsync's step time over torch's, "jax_ratio_vs_anchor": the same over the
JAX rows against GSPMD, "<row>_ratio_vs_anchor" for each row, "loss_difference" (the largest
relative loss difference of any row), "torch": {...}, "jax": {...}}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _nd_parallel_torch as tnd
from _jax_part import run_jax_part
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks

from gradsync_core.plan._llama import LLAMA_MODELS

MODEL = "llama-nd-bench"
LOSS_RTOL = 1e-5  # float32; --quick measured 6e-8 (torch) and 2.3e-7 (JAX)
MIB = 1024 * 1024
TORCH_ROWS = {  # row: (description, sizes)
    "torch_fsdp_tp_pp": ("dp_shard 2 x tp 2 x pp 2", {"dp_shard": 2, "tp": 2, "pp": 2}),
    "torch_hsdp_tp": (
        "dp_replicate 2 x dp_shard 2 x tp 2",
        {"dp_replicate": 2, "dp_shard": 2, "tp": 2},
    ),
}
JAX_ROWS = {
    "jax_dp_tp": ("dp 4 x tp 2", {"tp": 2, "dp_replicate": 4}),
    "jax_fsdp_tp": ("dp_shard 4 x tp 2", {"tp": 2, "dp_shard": 4}),
}


def predicted(
    sizes: dict[str, int], args: argparse.Namespace, executor: str, world: int = 8
) -> dict[str, Any]:
    """``gradsync plan``'s composed memory for ``sizes`` with the run's batch (activations
    counted; with pp, of the schedule's peak stash) for ``executor``'s program (``torch`` or
    ``jax``): its command and rows by pp rank."""
    command = ["gradsync", "plan", "--model", MODEL, "--world-size", str(world)]
    for axis in ("dp_replicate", "dp_shard", "tp", "pp"):
        if axis in sizes:
            command += [f"--{axis.replace('_', '-')}", str(sizes[axis])]
    command += ["--zero", "3", "--optimizer", "adamw"]
    command += ["--batch", str(args.batch), "--seq", str(args.seq)]
    if sizes.get("pp", 1) > 1:
        command += ["--schedule", args.schedule, "--microbatches", str(args.microbatches)]
    if executor != "torch":
        command += ["--executor", executor]
    done = subprocess.run(
        [sys.executable, "-m", "gradsync_core", *command[1:], "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.strip()}")
    rows = json.loads(done.stdout)["composed_memory"]
    return {"command": " ".join(command), "rows": {row["pp_rank"]: row for row in rows}}


def _jax(args: argparse.Namespace) -> dict[str, Any]:
    """The JAX part, in a process of its own (8 CPU devices, no torch)."""
    options = {
        "config": args.config,
        "seq": args.seq,
        "batch": args.batch,
        "warmup": args.warmup,
        "steps": args.steps,
        "configs": [[key, sizes] for key, (_, sizes) in JAX_ROWS.items() if key in args.rows],
    }
    result: dict[str, Any] = run_jax_part("_nd_parallel_jax.py", options)
    return result


def _mib(n: float) -> str:
    return f"{n / MIB:.2f}"


def _torch_table(results: dict[str, Any], args: argparse.Namespace) -> None:
    print(
        f"torch, 8 gloo ranks: {MODEL}, global batch {args.batch} x seq {args.seq}, "
        f"{args.schedule} with {args.microbatches} microbatches where pp > 1"
    )
    print(
        f"  {'configuration':<36}{'gradsync ms':>12}{'torch ms':>10}{'ratio':>9}"
        f"{'loss rel diff':>15}{'max weight diff':>17}"
    )
    for key, r in results.items():
        label = TORCH_ROWS[key][0]
        step = r["step_s"]
        print(
            f"  {label:<36}{step['gradsync'] * 1e3:>12.1f}{step['torch'] * 1e3:>10.1f}"
            f"{r['ratio']:>8.3f}x{r['loss_difference']:>15.1e}{r['param_difference']:>17.1e}"
        )
    print(
        "  memory per rank, MiB, the fullest rank of each pipeline stage: held (params + grads "
        "+ state) / peak (held params and state + the step's live rise, activations included)"
    )
    for key, r in results.items():
        label, plan = TORCH_ROWS[key][0], r["predicted"]
        print(f"  {label}: predicted by `{plan['command']}`")
        for pp_rank, row in sorted(plan["rows"].items()):
            want_held = row["parameter_bytes"] + row["gradient_bytes"]
            want_held += row["optimizer_state_bytes"]
            cells = [f"predicted {_mib(want_held)} / {_mib(row['peak_bytes'])}"]
            for side in ("gradsync", "torch"):
                held, peak = _stage_max(r, side, pp_rank)
                cells.append(
                    f"{side} {_mib(held)} / {_mib(peak)} ({held / want_held - 1:+.1%} / "
                    f"{peak / row['peak_bytes'] - 1:+.1%})"
                )
            print(f"    pp rank {pp_rank}: " + "; ".join(cells))


def _stage_max(result: dict[str, Any], side: str, pp_rank: int) -> tuple[int, int]:
    """The largest held and peak bytes over the ranks of pipeline rank ``pp_rank``."""
    rows = [
        m for m, p in zip(result["memory"][side], result["pp_rank"], strict=True) if p == pp_rank
    ]
    held = max(m["params"] + m["grads"] + m["state"] for m in rows)
    return held, max(m["peak"] for m in rows)


def _jax_table(results: dict[str, Any]) -> None:
    print("JAX, 8 CPU devices: the same model and batches, against GSPMD (NamedSharding + jit)")
    print(
        f"  {'configuration':<22}{'gradsync ms':>12}{'GSPMD ms':>10}{'ratio':>9}"
        f"{'loss rel diff':>15}{'max weight diff':>17}   held / peak MiB per device: "
        "predicted, gradsync, GSPMD"
    )
    for key, r in results.items():
        label = JAX_ROWS[key][0]
        step, plan = r["step_s"], r["predicted"]["rows"][0]
        want_held = plan["parameter_bytes"] + plan["optimizer_state_bytes"]
        cells = [f"{_mib(want_held)} / {_mib(plan['peak_bytes'])}"]
        for side in ("gradsync", "GSPMD"):
            held, peak = r[f"{side}_held_bytes"], r[f"{side}_peak_bytes"]
            cells.append(
                f"{_mib(held)} / {_mib(peak)} ({held / want_held - 1:+.1%} / "
                f"{peak / plan['peak_bytes'] - 1:+.1%})"
            )
        print(
            f"  {label:<22}{step['gradsync'] * 1e3:>12.1f}{step['GSPMD'] * 1e3:>10.1f}"
            f"{r['ratio']:>8.3f}x{r['loss_difference']:>15.1e}{r['param_difference']:>17.1e}   "
            + ", ".join(cells)
        )
    for key, r in results.items():
        print(f"  {JAX_ROWS[key][0]}: predicted by `{r['predicted']['command']}`")


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: the torch ranks, then the JAX process; print the tables, check the
    losses agree."""
    torch_results = spawn_ranks(tnd.worker, args) if args.configs else {}
    jax_results = _jax(args) if set(JAX_ROWS) & set(args.rows) else {}
    for key in torch_results:
        torch_results[key]["predicted"] = predicted(TORCH_ROWS[key][1], args, "torch")
    for key in jax_results:
        jax_results[key]["predicted"] = predicted(JAX_ROWS[key][1], args, "jax")
    if torch_results:
        _torch_table(torch_results, args)
    if jax_results:
        _jax_table(jax_results)
    figures: dict[str, Any] = {"bench": "nd_parallel", "model": MODEL}
    for key, r in [*torch_results.items(), *jax_results.items()]:
        figures[f"{key}_ratio_vs_anchor"] = r["ratio"]
    if torch_results:
        figures["ratio_vs_anchor"] = statistics.median(r["ratio"] for r in torch_results.values())
    if jax_results:
        figures["jax_ratio_vs_anchor"] = statistics.median(r["ratio"] for r in jax_results.values())
    every = [*torch_results.values(), *jax_results.values()]
    figures["loss_difference"] = max(r["loss_difference"] for r in every)
    figures["torch"], figures["jax"] = torch_results, jax_results
    bad = [k for k, r in [*torch_results.items(), *jax_results.items()] if not _agrees(r)]
    if bad:
        raise SystemExit(
            f"{', '.join(bad)}: the two sides' losses differ by more than {LOSS_RTOL:g} "
            "(relative), so they do not compute the same training; the timings mean nothing"
        )
    print(f"losses of every step agree within {LOSS_RTOL:g} relative on every row")
    return figures


def _agrees(result: dict[str, Any]) -> bool:
    return bool(result["loss_difference"] <= LOSS_RTOL)


RATIOS = (
    "ratio_vs_anchor",
    "jax_ratio_vs_anchor",
    *(f"{key}_ratio_vs_anchor" for key in (*TORCH_ROWS, *JAX_ROWS)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="1 warm-up and 2 timed steps")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps (default 2)")
    parser.add_argument("--batch", type=int, default=8, help="global batch (rows)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--schedule", choices=tuple(tnd.TORCH_SCHEDULES), default="1F1B")
    parser.add_argument(
        "--only", choices=("torch", "jax"), default=None, help="run one framework's rows alone"
    )
    parser.add_argument(
        "--row",
        action="append",
        choices=(*TORCH_ROWS, *JAX_ROWS),
        help="run this row alone (repeat the flag for several; default every row)",
    )
    add_repeat_arg(parser)
    args = parser.parse_args()
    args.steps = args.steps or (2 if args.quick else 10)
    args.warmup = args.warmup or (1 if args.quick else 2)
    args.world_size = 8
    args.config = dataclasses.asdict(LLAMA_MODELS[MODEL])
    frameworks = {"torch": TORCH_ROWS, "jax": JAX_ROWS}
    rows = [k for f, r in frameworks.items() if args.only in (None, f) for k in r]
    args.rows = [k for k in rows if not args.row or k in args.row]
    if not args.rows:
        parser.error(f"--only {args.only} leaves none of the rows {args.row}; drop one flag")
    args.configs = [(key, sizes) for key, (_, sizes) in TORCH_ROWS.items() if key in args.rows]
    runs = run_repeats(lambda index: measure(args), args.repeat)
    keys = [k for k in RATIOS if k in runs[0]]
    finish(runs, ratio_keys=keys, largest_keys=("loss_difference",))


if __name__ == "__main__":
    main()
