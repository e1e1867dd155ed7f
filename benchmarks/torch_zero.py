"""torch ZeRO step time and memory: torch's ZeroRedundancyOptimizer vs gradsync ZeRO-1/2.

docs/design.md §11: every variant runs in the same process tree, alternating step by step (the order
rotates every round), on the same model and data; each figure is the median over the timed
rounds of the slowest rank's step. A step is zero_grad(set_to_none=True), forward, loss,
backward and optimizer.step() (Adam): the optimizer and the parameter sync are what differ.

    DDP + Adam              torch DDP, plain torch.optim.Adam (every rank holds all state)
    DDP + torch ZeRO        torch DDP, torch.distributed.optim.ZeroRedundancyOptimizer(Adam)
    DDP + gradsync ZeRO-1   torch DDP, gradsync_torch.ZeroRedundancyOptimizer(Adam)
    gradsync DP + ZeRO-1    gradsync DataParallel, gradsync ZeRO-1
    gradsync DP + ZeRO-2    DataParallel(shard_gradients=True): gradients reduce-scattered
                            during backward, each rank keeps its shard; gradsync ZeRO-2

    python benchmarks/torch_zero.py                   # 24 x Linear(1024, 1024) + GELU, 2 ranks
    python benchmarks/torch_zero.py --quick           # fewer rounds, < 2 min on 2 cores
    python benchmarks/torch_zero.py --world-size 4    # 4 gloo ranks
    python benchmarks/torch_zero.py --profile         # + local step / param sync / rest split
    python benchmarks/torch_zero.py --repeat 5        # the whole run 5 times: median and range

``--model`` and the size options are torch_dp.py's (benchmarks/_torch_models.py). ``--profile``
adds an untimed pass after the timed rounds that splits each variant's ``opt.step()`` into the
local optimizer step, the parameter sync and the rest (benchmarks/_zero_profile.py).

The last line is one JSON object: {"bench": "torch_zero", "step_s": ..., "anchor_step_s": ...,
"ratio_vs_anchor": ..., "ratio_median": ..., "ratios": [...], ...}; the anchor is torch's
ZeroRedundancyOptimizer.
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _grad_memory import GradMemory
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
from _zero_profile import StepSplit

from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

VARIANTS = (
    "DDP + Adam",
    "DDP + torch ZeRO",
    "DDP + gradsync ZeRO-1",
    "gradsync DP + ZeRO-1",
    "gradsync DP + ZeRO-2",
)
ZERO1, ZERO2 = "DDP + gradsync ZeRO-1", "gradsync DP + ZeRO-2"
ANCHOR = "DDP + torch ZeRO"
MIB = 1024 * 1024
RATIO_KEYS = (
    "ratio_vs_anchor",
    "paired_ratio_vs_anchor",
    "zero2_ratio_vs_anchor",
    "zero2_paired_ratio_vs_anchor",
    "dp_zero1_paired_ratio_vs_anchor",
)


def _state_nbytes(opt: torch.optim.Optimizer) -> int:
    inner = getattr(opt, "optim", opt)  # both ZeRO wrappers keep a local optimizer there
    return sum(
        v.numel() * v.element_size()
        for state in inner.state.values()
        for v in state.values()
        if torch.is_tensor(v)
    )


def profile(
    setups: dict[str, tuple[nn.Module, torch.optim.Optimizer]],
    backward: Any,
    steps: int,
) -> list[list[float]]:
    """``steps`` untimed rounds with every variant's ``opt.step()`` split into local step,
    parameter sync and rest; per variant (whole, local, sync, rest) medians, slowest rank."""
    splits = {name: StepSplit(opt) for name, (_, opt) in setups.items()}
    try:
        for _ in range(steps):
            for name in VARIANTS:
                backward(name)
                dist.barrier()
                split = splits[name]
                n_local, n_sync = len(split.local_s), len(split.sync_s)
                split.step()
                # gradsync steps job by job inside its sync: one sum per step, and the sync
                # column keeps only the time not spent in local steps (exposed communication).
                split.local_s[n_local:] = [sum(split.local_s[n_local:])]
                split.sync_s[n_sync:] = [sum(split.sync_s[n_sync:])]
                if isinstance(setups[name][1], ZeroRedundancyOptimizer):
                    split.sync_s[-1] -= split.local_s[-1]
    finally:
        for split in splits.values():
            split.restore()
    medians = torch.tensor([splits[n].medians() for n in VARIANTS], dtype=torch.float64)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # NaN (a part not found) stays NaN
    return medians.tolist()


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(args.threads)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    try:
        base = build_model(args)
        setups: dict[str, tuple[nn.Module, torch.optim.Optimizer]] = {}
        recorders: dict[str, GradMemory] = {}
        for name in VARIANTS:
            module = copy.deepcopy(base)
            if name.startswith("DDP"):
                model: nn.Module = DistributedDataParallel(module)
            else:
                model = DataParallel(module, shard_gradients=name == ZERO2)
            if name == "DDP + Adam":
                opt: torch.optim.Optimizer = torch.optim.Adam(module.parameters(), lr=1e-4)
            elif name == "DDP + torch ZeRO":
                opt = TorchZero(module.parameters(), optimizer_class=torch.optim.Adam, lr=1e-4)
            else:
                opt = ZeroRedundancyOptimizer(
                    module.named_parameters(),
                    torch.optim.Adam,
                    lr=1e-4,
                    shard_gradients=name == ZERO2,
                    # ZeRO-2 steps the gradient shards that this DataParallel keeps.
                    data_parallel=model if name == ZERO2 else None,
                )
            setups[name] = (model, opt)
            # After the wrapper's hooks: samples see each gradient once it was handed over.
            recorders[name] = GradMemory(model, module.parameters())
        del base
        inputs, targets = make_batch(args, rank, torch.device("cpu"))

        def backward(name: str) -> None:
            model, opt = setups[name]
            opt.zero_grad(set_to_none=True)
            loss_of(model, inputs, targets).backward()

        def step(name: str, measure: bool) -> None:
            recorder = recorders[name]
            recorder.active = measure
            backward(name)
            if measure:
                recorder.sample()
            setups[name][1].step()
            if measure:
                recorder.sample()
                recorder.active = False

        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        rounds = args.warmup + args.steps
        for r in range(rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                step(name, measure=False)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                if r >= args.warmup:
                    times[name].append(elapsed.item())
        split = profile(setups, backward, args.steps) if args.profile else None
        for name in VARIANTS:
            step(name, measure=True)  # untimed: the accounting adds a sync of its own
        # Same grads, same Adam arithmetic: all must hold the same parameters (2 ranks: a
        # mean of two is exact in any order).
        reference = list(setups["DDP + Adam"][0].parameters())
        equal = {
            name: all(
                torch.equal(a, b)
                for a, b in zip(reference, setups[name][0].parameters(), strict=True)
            )
            for name in VARIANTS[1:]
        }
        memory = torch.tensor(
            [[_state_nbytes(setups[n][1]), recorders[n].peak] for n in VARIANTS],
            dtype=torch.int64,
        )
        dist.all_reduce(memory, op=dist.ReduceOp.MAX)  # the fullest rank
        if rank == 0:
            plan = setups[ZERO1][1].plan()  # type: ignore[union-attr]
            out.put(
                (
                    times,
                    equal,
                    memory.tolist(),
                    plan.imbalance,
                    count_params(setups[ANCHOR][0]),
                    split,
                )
            )
        dist.barrier()  # no rank tears gloo down while a peer still talks to it
    finally:
        dist.destroy_process_group()


def run_once(args: argparse.Namespace) -> tuple[Any, ...]:
    """Spawn the ranks, run every variant, return rank 0's measurements."""
    return spawn_ranks(worker, args)


def print_profile(split: list[list[float]]) -> dict[str, dict[str, float | None]]:
    """The step split table; returns it keyed by variant for the JSON object."""
    print(
        f"opt.step() split (--profile, untimed pass, median per step, slowest rank per column):\n"
        f"{'variant':<22} {'step (ms)':>10} {'local (ms)':>11} {'sync (ms)':>10} {'rest (ms)':>10}"
    )
    table: dict[str, dict[str, float | None]] = {}
    for name, row in zip(VARIANTS, split, strict=True):
        cells = [f"{v * 1e3:>10.2f}" if not math.isnan(v) else f"{'n/a':>10}" for v in row]
        print(f"{name:<22} {cells[0]} {cells[1]:>11} {cells[2]} {cells[3]}")
        table[name] = {
            key: None if math.isnan(v) else round(v, 6)
            for key, v in zip(("step_s", "local_step_s", "sync_s", "rest_s"), row, strict=True)
        }
    print(
        "local: the local optimizer's step (opt.optim.step, summed over its calls); sync: the "
        "parameter sync (torch: _sync_params after the local step; gradsync: layout.sync_params, "
        "which runs the local step job by job, less that local time; n/a: not found); "
        "rest: step - local - sync (bookkeeping); DDP + Adam has no wrapper, so all of it is rest"
    )
    return table


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: the tables on stdout, the figures as a dict."""
    times, equal, memory, imbalance, params, split = run_once(args)
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    anchor = medians[ANCHOR]
    state = {name: memory[i][0] for i, name in enumerate(VARIANTS)}
    grads = {name: memory[i][1] for i, name in enumerate(VARIANTS)}
    unsharded = state["DDP + Adam"]
    print(
        f"torch ZeRO, {describe(args, params)}, Adam, "
        f"{args.world_size} gloo ranks x {args.threads} thread(s), median of {args.steps} "
        f"steps after {args.warmup} warm-up"
    )
    # Each round ran every variant back to back, so per-round ratios cancel slow load drifts.
    paired = {
        name: statistics.median(t / a for t, a in zip(times[name], times[ANCHOR], strict=True))
        for name in VARIANTS
    }
    print(
        f"{'variant':<22} {'step (s)':>9} {'vs torch ZeRO':>14} {'paired':>7} {'min (s)':>8} "
        f"{'max (s)':>8} {'state MiB/rank':>15} {'vs Adam':>8} {'grad MiB/rank':>14}"
    )
    for name in VARIANTS:
        ts = times[name]
        print(
            f"{name:<22} {medians[name]:>9.3f} {medians[name] / anchor:>13.2f}x "
            f"{paired[name]:>6.2f}x {min(ts):>8.3f} {max(ts):>8.3f} {state[name] / MIB:>15.1f} "
            f"{state[name] / unsharded:>7.2f}x {grads[name] / MIB:>14.1f}"
        )
    print(
        "vs torch ZeRO: ratio of medians; paired: median of the per-round ratios; state: "
        "optimizer state on the fullest rank; grad: peak bytes of gradient storage on the "
        "fullest rank during one backward and step, measured from live tensors (param.grad, "
        "gradsync's bucket buffers and ZeRO-2 shards; DDP's C++ bucket buffers, about one "
        "more gradient copy, are not visible: benchmarks/_grad_memory.py)"
    )
    print(f"ZeRO-1 plan imbalance (max / mean load - 1): {imbalance:.4f}")
    print(
        "parameters equal to DDP + Adam after the run (bitwise; expected at 2 ranks, beyond "
        "that a different summation order may differ in the last bits): "
        + ", ".join(f"{name}: {ok}" for name, ok in equal.items())
    )
    zero1, zero2 = ZERO1, ZERO2
    result = {
        "bench": "torch_zero",
        "step_s": round(medians[zero1], 4),
        "anchor_step_s": round(anchor, 4),
        "ratio_vs_anchor": round(medians[zero1] / anchor, 3),
        "paired_ratio_vs_anchor": round(paired[zero1], 3),
        "zero2_step_s": round(medians[zero2], 4),
        "zero2_ratio_vs_anchor": round(medians[zero2] / anchor, 3),
        "zero2_paired_ratio_vs_anchor": round(paired[zero2], 3),
        "ddp_adam_step_s": round(medians["DDP + Adam"], 4),
        "dp_zero1_step_s": round(medians["gradsync DP + ZeRO-1"], 4),
        "dp_zero1_paired_ratio_vs_anchor": round(paired["gradsync DP + ZeRO-1"], 3),
        "state_bytes_per_rank": state[zero1],
        "anchor_state_bytes_per_rank": state[ANCHOR],
        "unsharded_state_bytes": unsharded,
        "state_ratio_vs_unsharded": round(state[zero1] / unsharded, 3),
        "plan_imbalance": round(imbalance, 4),
        "zero2_grad_bytes_per_rank": grads[zero2],
        "ddp_grad_bytes_per_rank": grads[zero1],
        "grad_peak_bytes_per_rank": grads,  # every variant, measured (see the table's note)
        "params_equal": equal,
        "world_size": args.world_size,
        "params": params,
        "steps": args.steps,
        "model": args.model,
    }
    if split is not None:
        result["profile"] = print_profile(split)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_common_args(parser)
    add_repeat_arg(parser)
    parser.add_argument("--threads", type=int, help="per rank (default: cores / ranks)")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timed rounds, split opt.step() into local step, param sync and rest",
    )
    args = parser.parse_args(argv)
    fill_model_defaults(args)
    args.world_size = args.world_size or 2
    if args.threads is None:
        args.threads = max(1, len(os.sched_getaffinity(0)) // args.world_size)
    if args.steps is None:
        args.steps = 6 if args.quick else 20
    if args.quick:
        args.warmup = min(args.warmup, 2)
    runs = run_repeats(lambda _: measure(args), args.repeat)
    return finish(runs, RATIO_KEYS)


if __name__ == "__main__":
    main()
