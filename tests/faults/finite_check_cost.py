"""What ``DataParallel(check_finite=True)`` costs per step, paired against the same wrapper
without it (issue 21, item 6; docs/torch-data-parallel.md, "Finding a NaN gradient").

Two ranks on gloo (CPU). Both wrappers hold copies of one model and step alternately, the
order swapping every round, on the same batch; a step is zero_grad, forward, loss, backward
(the sync runs inside backward). Reported: the median over rounds of the slowest rank's
step time for each, and the median of the per-round ratios (checked / plain).

    python -m tests.faults.finite_check_cost                      # 8 x Linear(1024, 1024)
    python -m tests.faults.finite_check_cost --layers 200 --width 64 --rounds 60
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_torch as gt
from tests.support.harness import run_workers


def _model(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*blocks)


def _step(model: nn.Module, x: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    model.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    took = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(took, op=dist.ReduceOp.MAX)  # the slowest rank's step
    return float(took)


def _measure(rank: int, world_size: int, layers: int, width: int, rounds: int) -> Any:
    base = _model(layers, width)
    plain = gt.DataParallel(copy.deepcopy(base))
    checked = gt.DataParallel(copy.deepcopy(base), check_finite=True)
    x = torch.randn(32, width, generator=torch.Generator().manual_seed(rank))
    for _ in range(3):  # warm-up (and the first sync's rebuild)
        _step(plain, x)
        _step(checked, x)
    times: dict[str, list[float]] = {"plain": [], "checked": []}
    for r in range(rounds):
        order = ("plain", "checked") if r % 2 == 0 else ("checked", "plain")
        for name in order:
            times[name].append(_step(plain if name == "plain" else checked, x))
    ratios = [c / p for c, p in zip(times["checked"], times["plain"], strict=True)]
    return {
        "params": sum(p.numel() for p in base.parameters()),
        "plain_step_s": statistics.median(times["plain"]),
        "checked_step_s": statistics.median(times["checked"]),
        "paired_ratio_median": statistics.median(ratios),
    }


def main(argv: list[str] | None = None) -> None:
    """Print one JSON line: the step times and the paired ratio."""
    parser = argparse.ArgumentParser(description=__doc__.partition("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=40)
    args = parser.parse_args(argv)
    result = run_workers(_measure, 2, args.layers, args.width, args.rounds, timeout=1200)[0]
    print(json.dumps({"bench": "check_finite", **vars(args), **result}))


if __name__ == "__main__":
    main()
