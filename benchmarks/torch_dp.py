"""torch data-parallel step time: torch DDP vs gradsync overlap vs gradsync legacy vs no sync.

docs/design.md §11: all four run in the same process tree, alternating step by step (the order
rotates every round), on the same model and data; each figure is the median over the timed
rounds of the slowest rank's step. "compute only" is the same step without any gradient sync,
the lower bound. A step is zero_grad(set_to_none=True), forward, loss, backward (and, in legacy
mode, sync_gradients()); the optimizer is left out because it costs every variant the same.

    python benchmarks/torch_dp.py                      # 24 x Linear(1024, 1024) + GELU, 2 ranks
    python benchmarks/torch_dp.py --quick              # fewer rounds, < 2 min on 2 cores
    python benchmarks/torch_dp.py --model many-small   # 500 x Linear(64, 64), tanh residuals
    python benchmarks/torch_dp.py --device cuda --model gpt   # NCCL, one rank per GPU, bf16
    python benchmarks/torch_dp.py --repeat 5           # the whole run 5 times: median and range

On ``--device cuda`` every rank owns one visible GPU (world size = the GPU count unless
``--world-size`` asks for fewer), gradients go through NCCL, forward and loss run under bf16
autocast, and each step is timed between two ``torch.cuda.synchronize()``. On the CPU the
ranks talk over gloo. The last line is one JSON object: {"bench": "torch_dp", "step_s": ...,
"anchor_step_s": ..., "ratio_vs_anchor": ..., "ratio_median": ..., "ratios": [...], ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks
from _torch_models import (
    add_common_args,
    build_model,
    count_params,
    describe,
    fill_model_defaults,
    loss_of,
    make_batch,
)

from gradsync_torch import DataParallel

VARIANTS = ("torch DDP", "gradsync overlap", "gradsync legacy", "compute only")
ANCHOR = "torch DDP"
RATIO_KEYS = (
    "ratio_vs_anchor",
    "paired_ratio_vs_anchor",
    "legacy_ratio_vs_anchor",
    "legacy_paired_ratio_vs_anchor",
)


def _grad_difference(reference: torch.nn.Module, other: torch.nn.Module) -> tuple[bool, float]:
    """(bitwise equal, largest |a - b| / max |a|) over the parameters' gradients."""
    equal, worst = True, 0.0
    for a, b in zip(reference.parameters(), other.parameters(), strict=True):
        equal = equal and torch.equal(a.grad, b.grad)
        scale = a.grad.abs().max().item() or 1.0
        worst = max(worst, (a.grad.float() - b.grad.float()).abs().max().item() / scale)
    return equal, worst


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(args.threads)
    on_gpu = args.device == "cuda"
    if on_gpu:
        torch.cuda.set_device(rank)
    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    store = dist.FileStore(store_path, world_size)
    backend = "nccl" if on_gpu else "gloo"
    dist.init_process_group(
        backend,
        store=store,
        rank=rank,
        world_size=world_size,
        device_id=device if on_gpu else None,  # barrier() then knows its GPU
    )
    try:
        base = build_model(args).to(device)
        models = {
            "torch DDP": DistributedDataParallel(copy.deepcopy(base)),
            "gradsync overlap": DataParallel(copy.deepcopy(base)),
            "gradsync legacy": DataParallel(copy.deepcopy(base), overlap=False),
            "compute only": copy.deepcopy(base),
        }
        del base
        inputs, targets = make_batch(args, rank, device)

        def autocast() -> contextlib.AbstractContextManager[Any]:
            if on_gpu:  # bf16 is how such models train on a GPU
                return torch.autocast("cuda", dtype=torch.bfloat16)
            return contextlib.nullcontext()

        def step(name: str) -> None:
            model = models[name]
            model.zero_grad(set_to_none=True)
            with autocast():
                loss = loss_of(model, inputs, targets)
            loss.backward()
            if name == "gradsync legacy":
                model.sync_gradients()

        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.warmup + args.steps):
            order = VARIANTS[r % 4 :] + VARIANTS[: r % 4]
            for name in order:
                dist.barrier()
                if on_gpu:
                    torch.cuda.synchronize()
                start = time.perf_counter()
                step(name)
                if on_gpu:  # kernels run asynchronously: wait for them before stopping
                    torch.cuda.synchronize()
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                elapsed = elapsed.to(device)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                if r >= args.warmup:
                    times[name].append(elapsed.item())
        # Same model, same data: gradients must match DDP's (bitwise on gloo at 2 ranks).
        ddp = models[ANCHOR]
        equal, max_rel = True, 0.0
        for name in ("gradsync overlap", "gradsync legacy"):
            same, rel = _grad_difference(ddp, models[name])
            equal, max_rel = equal and same, max(max_rel, rel)
        if rank == 0:
            n_buckets = len(models["gradsync overlap"].bucket_plan.buckets)
            out.put((times, equal, max_rel, n_buckets, count_params(ddp)))
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def run_once(args: argparse.Namespace) -> tuple[Any, ...]:
    """Spawn the ranks, run every variant, return rank 0's measurements."""
    return spawn_ranks(worker, args)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: the table on stdout, the figures as a dict."""
    times, equal, max_rel, n_buckets, params = run_once(args)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    anchor = medians[ANCHOR]
    backend = "NCCL" if args.device == "cuda" else "gloo"
    print(
        f"torch data-parallel, {describe(args, params)}, {args.world_size} {backend} ranks x "
        f"{args.threads} thread(s), median of {args.steps} steps after {args.warmup} warm-up, "
        f"gradsync buckets: {n_buckets}"
    )
    # Each round ran every variant back to back, so per-round ratios cancel slow load drifts.
    paired = {
        name: statistics.median(t / a for t, a in zip(times[name], times[ANCHOR], strict=True))
        for name in VARIANTS
    }
    print(
        f"{'variant':<18} {'step (s)':>9} {'vs DDP':>7} {'paired':>7} {'min (s)':>8} {'max (s)':>8}"
    )
    for name in VARIANTS:
        ts = times[name]
        print(
            f"{name:<18} {medians[name]:>9.4f} {medians[name] / anchor:>6.2f}x "
            f"{paired[name]:>6.2f}x {min(ts):>8.4f} {max(ts):>8.4f}"
        )
    print("vs DDP: ratio of medians; paired: median of the per-round ratios")
    print(
        f"gradients equal to torch DDP's (bitwise): {equal}; "
        f"largest relative difference: {max_rel:.3g}"
    )
    overlap, legacy = medians["gradsync overlap"], medians["gradsync legacy"]
    return {
        "bench": "torch_dp",
        "model": args.model,
        "device": args.device,
        "step_s": round(overlap, 5),
        "anchor_step_s": round(anchor, 5),
        "ratio_vs_anchor": round(overlap / anchor, 4),
        "paired_ratio_vs_anchor": round(paired["gradsync overlap"], 4),
        "legacy_step_s": round(legacy, 5),
        "legacy_ratio_vs_anchor": round(legacy / anchor, 4),
        "legacy_paired_ratio_vs_anchor": round(paired["gradsync legacy"], 4),
        "compute_step_s": round(medians["compute only"], 5),
        "grads_equal_ddp": equal,
        "grads_max_rel_diff": float(f"{max_rel:.3g}"),
        "world_size": args.world_size,
        "params": params,
        "steps": args.steps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    add_repeat_arg(parser)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--threads", type=int, help="torch threads per rank (default: cores / ranks)"
    )
    args = parser.parse_args(argv)
    fill_model_defaults(args, args.device)
    if args.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise SystemExit("--device cuda: torch sees no GPU; drop the flag to run on the CPU")
        if args.world_size is None:
            args.world_size = gpus
        elif args.world_size > gpus:
            raise SystemExit(
                f"--world-size {args.world_size} but {gpus} GPU(s) visible; NCCL needs one "
                "GPU per rank, so pass --world-size <= the GPU count"
            )
    elif args.world_size is None:
        args.world_size = 2
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.world_size)
    if args.steps is None:
        args.steps = 10 if args.quick else 20
    runs = run_repeats(lambda _: measure(args), args.repeat)
    return finish(runs, RATIO_KEYS, largest_keys=("grads_max_rel_diff",))


if __name__ == "__main__":
    main()
