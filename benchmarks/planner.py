"""Planner speed: bucket plan + greedy partition for 100,000 tensors, and every standard group
of a 65,536-rank topology (target: each under 1 s).

Anchors, run in the same process: torch's C++ DDP bucket assignment
(``dist._compute_bucket_assignment_by_size``) on the same shapes as meta tensors, when torch
is installed, and a direct transcription of Megatron-core's
``generate_masked_orthogonal_rank_groups`` for the groups.

    python benchmarks/planner.py [--quick]
    python benchmarks/planner.py --repeat 5    # the whole run 5 times: median and range

The last line printed is one JSON object with the figures, including each anchor ratio
(``bucket_plan_ratio_vs_anchor``, ``groups_ratio_vs_anchor``) and its spread over the repeats.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from _report import add_repeat_arg, finish, run_repeats

from gradsync_core import (
    DEFAULT_CAP_BYTES,
    DEFAULT_FIRST_CAP_BYTES,
    STANDARD_GROUPS,
    ParamSpec,
    Topology,
    plan_buckets,
    plan_greedy_shards,
)
from tests.core.test_topology import megatron_groups

SHAPES = [(4096, 4096), (4096,), (11008, 4096), (4096, 11008), (1024, 1024), (1024,), (64, 3, 3)]


def make_specs(count: int) -> list[ParamSpec]:
    return [
        ParamSpec(name=f"layers.{i // 7}.p{i % 7}", shape=SHAPES[i % len(SHAPES)])
        for i in range(count)
    ]


def best_of(fn, repeats: int) -> tuple[float, float]:
    """(fastest, median) seconds of ``repeats`` calls of ``fn``."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times), statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--tensors", type=int, default=100_000)
    parser.add_argument("--ranks", type=int, default=65_536)
    parser.add_argument("--dp-for-partition", type=int, default=64)
    add_repeat_arg(parser)
    args = parser.parse_args()
    runs = run_repeats(lambda _: measure(args), args.repeat)
    keys = ["groups_ratio_vs_anchor"]
    if runs[0]["bucket_plan_ratio_vs_anchor"] is not None:
        keys.insert(0, "bucket_plan_ratio_vs_anchor")
    finish(runs, keys)


def measure(args: argparse.Namespace) -> dict:
    """One whole run: the table on stdout, the figures as a dict."""
    repeats = 3 if args.quick else 7
    specs = make_specs(args.tensors)
    _, bucket_s = best_of(
        lambda: plan_buckets(
            specs, cap_bytes=DEFAULT_CAP_BYTES, first_cap_bytes=DEFAULT_FIRST_CAP_BYTES
        ),
        repeats,
    )
    _, greedy_s = best_of(
        lambda: plan_greedy_shards(specs, world_size=args.dp_for_partition), repeats
    )

    anchor_bucket_s = None
    try:
        import torch
        import torch.distributed as dist

        tensors = [torch.empty(s.shape, device="meta") for s in specs]
        _, anchor_bucket_s = best_of(
            lambda: dist._compute_bucket_assignment_by_size(
                tensors, [DEFAULT_FIRST_CAP_BYTES, DEFAULT_CAP_BYTES], [False] * len(tensors)
            ),
            repeats,
        )
    except ImportError:
        pass

    topo = Topology.create(args.ranks, tp=8, cp=2, pp=4)
    _, groups_s = best_of(lambda: [topo.groups(name) for name in STANDARD_GROUPS], repeats)
    tokens = topo.tokens
    sizes = [getattr(topo, t) for t in tokens]

    def megatron_all():
        for name in STANDARD_GROUPS:
            members = set(name.split("-"))
            megatron_groups(topo.world_size, sizes, [t in members for t in tokens])

    _, anchor_groups_s = best_of(megatron_all, 1 if args.quick else 3)

    rows = [
        (
            f"bucket plan, {args.tensors:,} tensors",
            bucket_s,
            anchor_bucket_s,
            "torch C++ DDP assignment",
        ),
        (
            f"greedy partition, {args.tensors:,} tensors, dp={args.dp_for_partition}",
            greedy_s,
            None,
            "",
        ),
        (
            f"all {len(STANDARD_GROUPS)} standard groups, {args.ranks:,} ranks",
            groups_s,
            anchor_groups_s,
            "Megatron-core algorithm (Python)",
        ),
    ]
    print(f"{'what':<52} {'gradsync s':>10} {'anchor s':>9}  anchor")
    for what, ours, anchor, anchor_name in rows:
        a = f"{anchor:9.3f}" if anchor is not None else f"{'-':>9}"
        print(f"{what:<52} {ours:10.3f} {a}  {anchor_name}")
    print(f"(median of {repeats} runs; topology tp=8 cp=2 pp=4 dp={topo.dp}; target < 1 s each)")
    return {
        "bench": "planner",
        "tensors": args.tensors,
        "ranks": args.ranks,
        "bucket_plan_s": round(bucket_s, 4),
        "anchor_torch_bucket_assignment_s": None
        if anchor_bucket_s is None
        else round(anchor_bucket_s, 4),
        "bucket_plan_ratio_vs_anchor": None
        if anchor_bucket_s is None
        else round(bucket_s / anchor_bucket_s, 4),
        "greedy_partition_s": round(greedy_s, 4),
        "plan_plus_partition_s": round(bucket_s + greedy_s, 4),
        "standard_groups_s": round(groups_s, 4),
        "anchor_megatron_groups_s": round(anchor_groups_s, 4),
        "groups_ratio_vs_anchor": round(groups_s / anchor_groups_s, 4),
    }


if __name__ == "__main__":
    main()
