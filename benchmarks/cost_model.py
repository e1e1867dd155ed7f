"""The cost model against what runs: calibrate, predict and measure configurations (issue 38).

On this machine's gloo ranks (2 and 4) and JAX's 8 CPU devices: ``gradsync calibrate``'s
measurement (``calibrate_local``; JAX's ``calibrate``), a model profile measured on the ranks
themselves, then for each configuration the prediction (``gradsync_core.plan.predict``, on the
plans the executors are then built from) beside the measured median step time and peak bytes.
Reports per configuration the relative errors, then the median and worst error of the step
time, the worst error of the peak, and whether the search's first choice (the first of the
configurations run in the search's order, ``rank_key``) is within 5 % of the fastest measured.

    python benchmarks/cost_model.py            # both frameworks, worlds 2 and 4
    python benchmarks/cost_model.py --quick    # fewer steps
    python benchmarks/cost_model.py --frameworks torch --worlds 2 --only "zero3,pp2"

The last line is one JSON object: {"bench": "cost_model", "median_step_error": ...,
"worst_step_error": ..., "worst_peak_error": ..., "search_first_within_5pct": ..., ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _cost_torch
from _cost_report import report
from _jax_part import run_jax_part
from _spawn import spawn_ranks

from gradsync_core.plan import Configuration
from gradsync_torch.cost.machine import calibrate_local

TORCH_CONFIGS = {
    2: [
        Configuration(bucket_cap_mb=1),
        Configuration(bucket_cap_mb=4),
        Configuration(bucket_cap_mb=25),
        Configuration(bucket_cap_mb=25, overlap=False),
        Configuration(zero=1, bucket_cap_mb=25),
        Configuration(zero=2, bucket_cap_mb=25),
        Configuration(zero=3),
        Configuration(zero=3, reshard_after_forward=False),
        Configuration(pp=2, schedule="GPipe", microbatches=4),
        Configuration(pp=2, schedule="1F1B", microbatches=4),
    ],
    4: [
        Configuration(bucket_cap_mb=1),
        Configuration(bucket_cap_mb=25),
        Configuration(bucket_cap_mb=25, overlap=False),
        Configuration(zero=1, bucket_cap_mb=25),
        Configuration(zero=2, bucket_cap_mb=25),
        Configuration(zero=3),
        Configuration(zero=3, dp_shard=2),
        Configuration(pp=2, schedule="1F1B", microbatches=4),
    ],
}


def _torch(args: argparse.Namespace, world: int) -> list[dict[str, Any]]:
    start = time.perf_counter()
    machine = calibrate_local(world)
    calibrate_s = time.perf_counter() - start
    print(f"calibrate torch gloo x{world}: {calibrate_s:.1f} s ({machine.source})", flush=True)
    run = argparse.Namespace(**vars(args))
    run.world_size = world
    run.machine = machine.to_json()
    run.configurations = [c.to_json() for c in selected(TORCH_CONFIGS[world], args.only)]
    rows = spawn_ranks(_cost_torch.worker, run)
    for row in rows:
        row["framework"] = f"torch x{world}"
        row["calibrate_s"] = calibrate_s
    return rows


def _jax(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The JAX part, in a process of its own (8 CPU devices, no torch)."""
    options = {
        "layers": args.layers,
        "width": args.width,
        "global_batch": args.global_batch,
        "profile_steps": args.profile_steps,
        "warmup": args.warmup,
        "steps": args.steps,
        "only": args.only,
    }
    rows: list[dict[str, Any]] = run_jax_part("_cost_jax.py", options, timeout_s=1800)
    print(f"calibrate jax x8: {rows[0]['calibrate_s']:.1f} s", flush=True)
    return rows


def selected(configs: list[Configuration], only: str | None) -> list[Configuration]:
    """The configurations whose label contains one of ``only``'s comma-separated parts."""
    if not only:
        return configs
    parts = [part.strip() for part in only.split(",") if part.strip()]
    return [c for c in configs if any(part in c.describe() for part in parts)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer timed rounds")
    # 40 rounds: two configurations a few % apart (torch's GPipe and 1F1B at 2 ranks) came out
    # of 20-round medians up to 7 % apart either way (docs/cost-model.md)
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 40)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--worlds", default="2,4", help="torch world sizes")
    parser.add_argument("--frameworks", default="torch,jax")
    parser.add_argument(
        "--only", default=None, help="comma-separated label parts: run the matching ones only"
    )
    parser.add_argument(
        "--save",
        default=None,
        help="write the rows with the profiles each prediction read to this JSON file "
        "(cost_replay.py predicts them again)",
    )
    args = parser.parse_args(argv)
    args.steps = args.steps or (8 if args.quick else 40)
    rows: list[dict[str, Any]] = []
    if "torch" in args.frameworks:
        for world in map(int, args.worlds.split(",")):
            rows += _torch(args, world)
    if "jax" in args.frameworks:
        rows += _jax(args)
    if args.save:
        shape = {"layers": args.layers, "width": args.width, "global_batch": args.global_batch}
        with open(args.save, "w") as f:
            json.dump({"bench": "cost_model", **shape, "rows": rows}, f)
    for row in rows:
        del row["inputs"]
    return report(rows)


if __name__ == "__main__":
    main()
