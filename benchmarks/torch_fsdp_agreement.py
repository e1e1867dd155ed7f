"""What `fully_shard`'s runtime agreement costs: the same ZeRO-3 GPT step three ways.

docs/torch-zero3.md ("Never a hang"): the ranks check that they run the same collectives so a
mismatch gives a sentence instead of a hang. This runs, alternating step by step in one process
tree (the order rotating every round), three gradsync ZeRO-3 copies of the benchmarks' GPT:

    per phase     the shipped default: every collective checked in the first step, then two
                  checks per step (the backward's start and end) against the learnt schedule
    per collective  one check before every all-gather and reduce-scatter (the first version;
                  what HSDP still does)
    none          no check (switched off through the step's internals: not a user option,
                  a mismatch would hang)

Each figure is the median over the timed rounds of the slowest rank: the step, the time spent
inside the checks (``agree_on``, counted and timed by wrapping it), and the checks per step.

    python benchmarks/torch_fsdp_agreement.py --rounds 8        # 2 gloo ranks
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _spawn import spawn_ranks
from _torch_models import build_model, fill_model_defaults, loss_of, make_batch

MODES = ("per phase", "per collective", "none")


class CheckMeter:
    """Counts and times every call of the agreement module's ``agree_on``."""

    def __init__(self) -> None:
        import gradsync_torch.param_sharding._agreement as agreement

        self.calls, self.spent = 0, 0.0
        inner = agreement.agree_on

        def timed(*args: Any, **kwargs: Any) -> Any:
            self.calls += 1
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.spent += time.perf_counter() - start

        agreement.agree_on = timed

    def reset(self) -> None:
        self.calls, self.spent = 0, 0.0


def sharded_model(args: argparse.Namespace, mode: str) -> torch.nn.Module:
    from gradsync_torch import fully_shard

    torch.manual_seed(0)
    model = build_model(args)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    step = model._gradsync_shard_unit.step
    if mode != "per phase":
        step.agreement.scheduled = False  # check each collective
    if mode == "none":
        for unit in step.units:
            unit.params.check = None
    return model


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    meter = CheckMeter()
    runs = {}
    for mode in MODES:
        model = sharded_model(args, mode)
        runs[mode] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    batch = make_batch(args, rank, torch.device("cpu"))
    rows: dict[str, list[tuple[float, float, int]]] = {mode: [] for mode in MODES}
    for round_ in range(args.warmup + args.rounds):
        shift = round_ % len(MODES)
        for mode in MODES[shift:] + MODES[:shift]:
            model, optim = runs[mode]
            dist.barrier()
            meter.reset()
            start = time.perf_counter()
            loss_of(model, *batch).backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            slowest = torch.tensor([time.perf_counter() - start, meter.spent])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                rows[mode].append((slowest[0].item(), slowest[1].item(), meter.calls))
    if rank == 0:
        out.put(
            {
                mode: {
                    "step_s": statistics.median(r[0] for r in rs),
                    "in_checks_s": statistics.median(r[1] for r in rs),
                    "checks_per_step": rs[-1][2],
                }
                for mode, rs in rows.items()
            }
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    args.model, args.vocab = "gpt", 32000
    args.layers = args.width = args.batch = args.seq = args.heads = None
    fill_model_defaults(args)
    result = spawn_ranks(worker, args)
    none = result["none"]["step_s"]
    header = ("agreement", "checks/step", "in checks (ms)", "step (s)", "vs none")
    print("{:<16} {:>11} {:>15} {:>9} {:>8}".format(*header))
    for mode, row in result.items():
        print(
            f"{mode:<16} {row['checks_per_step']:>11} {1e3 * row['in_checks_s']:>15.1f} "
            f"{row['step_s']:>9.3f} {row['step_s'] / none:>7.3f}x"
        )
    print(json.dumps({"bench": "torch_fsdp_agreement", "world_size": args.world_size, **result}))


if __name__ == "__main__":
    main()
