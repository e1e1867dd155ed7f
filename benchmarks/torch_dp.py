"""torch data-parallel step time: torch DDP vs gradsync overlap vs gradsync legacy vs no sync.

docs/design.md §11: all four run in the same process tree, alternating step by step (the order rotates
every round), on the same model and data; each figure is the median over the timed rounds of
the slowest rank's step. "compute only" is the same step without any gradient sync, the lower
bound. A step is zero_grad(set_to_none=True), forward, loss, backward (and, in legacy mode,
sync_gradients()); the optimizer is left out because it costs every variant the same.

    python benchmarks/torch_dp.py            # 24 x Linear(1024, 1024) + GELU, batch 32, 2 ranks
    python benchmarks/torch_dp.py --quick    # fewer rounds, < 2 min on 2 cores

The last line is one JSON object: {"bench": "torch_dp", "step_s": ..., "anchor_step_s": ...,
"ratio_vs_anchor": ...}.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gradsync_torch import DataParallel

VARIANTS = ("torch DDP", "gradsync overlap", "gradsync legacy", "compute only")


def build_model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(args.threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        base = build_model(args.layers, args.width)
        models = {
            "torch DDP": DistributedDataParallel(copy.deepcopy(base)),
            "gradsync overlap": DataParallel(copy.deepcopy(base)),
            "gradsync legacy": DataParallel(copy.deepcopy(base), overlap=False),
            "compute only": copy.deepcopy(base),
        }
        del base
        gen = torch.Generator().manual_seed(1000 + rank)
        x = torch.randn(args.batch, args.width, generator=gen)

        def step(name: str) -> None:
            model = models[name]
            model.zero_grad(set_to_none=True)
            model(x).square().mean().backward()
            if name == "gradsync legacy":
                model.sync_gradients()

        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        rounds = args.warmup + args.steps
        for r in range(rounds):
            order = VARIANTS[r % 4 :] + VARIANTS[: r % 4]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                if r >= args.warmup:
                    times[name].append(elapsed.item())
        # Same model, same data, same arithmetic at 2 ranks: gradients must match DDP's.
        ddp, overlap, legacy = (models[n] for n in VARIANTS[:3])
        equal = all(
            torch.equal(a.grad, b.grad) and torch.equal(a.grad, c.grad)
            for a, b, c in zip(
                ddp.parameters(), overlap.parameters(), legacy.parameters(), strict=True
            )
        )
        if rank == 0:
            out.put((times, equal, len(overlap.bucket_plan.buckets)))
    finally:
        dist.destroy_process_group()


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every torch benchmark shares: rounds, world size and the model's size."""
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 2 min)")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=32)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default: cores / ranks)"
    )
    args = parser.parse_args(argv)
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 2) // args.world_size)
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=worker, args=(r, args.world_size, store, args, out))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        times, equal, n_buckets = out.get(timeout=1800)
        for p in procs:
            p.join()
            if p.exitcode != 0:
                raise SystemExit(f"a benchmark rank exited with code {p.exitcode}")
    params = args.layers * (args.width * args.width + args.width)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    anchor = medians["torch DDP"]
    print(
        f"torch data-parallel, {args.layers} x Linear({args.width}, {args.width}) + GELU "
        f"({params / 1e6:.1f} M parameters), batch {args.batch} per rank, "
        f"{args.world_size} gloo ranks x {args.threads} thread(s), median of {args.steps} "
        f"steps after {args.warmup} warm-up, gradsync buckets: {n_buckets}"
    )
    # Each round ran every variant back to back, so per-round ratios cancel slow load drifts.
    paired = {
        name: statistics.median(t / a for t, a in zip(times[name], times["torch DDP"], strict=True))
        for name in VARIANTS
    }
    header = (
        f"{'variant':<18} {'step (s)':>9} {'vs DDP':>7} {'paired':>7} {'min (s)':>8} {'max (s)':>8}"
    )
    print(header)
    for name in VARIANTS:
        ts = times[name]
        print(
            f"{name:<18} {medians[name]:>9.3f} {medians[name] / anchor:>6.2f}x "
            f"{paired[name]:>6.2f}x {min(ts):>8.3f} {max(ts):>8.3f}"
        )
    print("vs DDP: ratio of medians; paired: median of the per-round ratios")
    print(f"gradients equal to torch DDP's (bitwise): {equal}")
    result = {
        "bench": "torch_dp",
        "step_s": round(medians["gradsync overlap"], 4),
        "anchor_step_s": round(anchor, 4),
        "ratio_vs_anchor": round(medians["gradsync overlap"] / anchor, 3),
        "paired_ratio_vs_anchor": round(paired["gradsync overlap"], 3),
        "legacy_step_s": round(medians["gradsync legacy"], 4),
        "compute_step_s": round(medians["compute only"], 4),
        "grads_equal_ddp": equal,
        "world_size": args.world_size,
        "params": params,
        "steps": args.steps,
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
