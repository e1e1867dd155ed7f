"""Checks of ``DataParallel`` under torch's ``Join`` (uneven inputs), run inside spawned gloo
ranks by ``test_join.py``: each compares with torch DDP + ``Join`` on the same model and data,
bitwise (same buckets, same arithmetic). This module holds no tests of its own."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_torch as gt
from tests.torch.dp_grad_checks import mlp


def batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Rank r gets 3 + r batches (3, 4 and 5 on three ranks)."""
    gen = torch.Generator().manual_seed(1000 + rank)
    return [
        (torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
        for _ in range(3 + rank)
    ]


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, join: Join) -> list:
    """The uneven loop; returns the gradients this rank saw after each of its steps."""
    seen = []
    with join:
        for x, y in batches(rank):
            opt.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
            seen.append([p.grad.clone() for p in model.parameters()])
            opt.step()
    return seen


def check_matches_ddp(rank: int, ws: int, divide_by_initial_world_size: bool) -> None:
    base = mlp(seed=3)
    ours_model = gt.DataParallel(copy.deepcopy(base))
    theirs_model = DDP(copy.deepcopy(base))
    ours_opt = torch.optim.AdamW(ours_model.parameters(), lr=1e-2)
    theirs_opt = torch.optim.AdamW(theirs_model.parameters(), lr=1e-2)
    kwargs = {"divide_by_initial_world_size": divide_by_initial_world_size}
    theirs = train(theirs_model, theirs_opt, rank, theirs_model.join(**kwargs))
    ours = train(ours_model, ours_opt, rank, ours_model.join(**kwargs))
    assert len(ours) == len(theirs) == 3 + rank
    for step, (a, b) in enumerate(zip(ours, theirs, strict=True)):
        for ga, gb in zip(a, b, strict=True):
            assert torch.equal(ga, gb), f"step {step}: gradients differ from DDP + Join"
    for pa, pb in zip(ours_model.parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(pa, pb), "final parameters differ from DDP + Join"
    # post_hook: every rank ends with the model of a rank that ran last
    flat = torch.cat([p.detach().reshape(-1) for p in ours_model.parameters()])
    everyone = [torch.empty_like(flat) for _ in range(ws)]
    dist.all_gather(everyone, flat)
    assert all(torch.equal(flat, other) for other in everyone)


def check_zero_joins(rank: int, ws: int) -> None:
    """Join([model, zero]): the ZeRO optimizer's step is shadowed too; every rank ends with
    the parameters of DataParallel + plain AdamW under the same Join."""
    base = mlp(seed=4)
    plain_model = gt.DataParallel(copy.deepcopy(base))
    plain_opt = torch.optim.AdamW(plain_model.parameters(), lr=1e-2)
    zero_model = gt.DataParallel(copy.deepcopy(base))
    zero_opt = gt.ZeroRedundancyOptimizer(
        zero_model.parameters(), optimizer_class=torch.optim.AdamW, lr=1e-2
    )
    train(plain_model, plain_opt, rank, plain_model.join())
    train(zero_model, zero_opt, rank, Join([zero_model, zero_opt]))
    for pa, pb in zip(zero_model.parameters(), plain_model.parameters(), strict=True):
        assert torch.equal(pa, pb), "ZeRO under Join differs from plain AdamW under Join"


CHECKS = {
    "matches-ddp-initial-world-size": lambda r, ws: check_matches_ddp(r, ws, True),
    "matches-ddp-running-ranks": lambda r, ws: check_matches_ddp(r, ws, False),
    "zero-joins": check_zero_joins,
}
