"""Checks of DataParallel's setup and state that run inside spawned gloo ranks: buffers,
broadcasts, fail-fast mismatch detection and errors. Run by ``test_data_parallel.py``; the
helpers and tolerances live in ``dp_grad_checks.py``. No tests of its own.
"""

from __future__ import annotations

import copy
import gc

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_torch as gt
from gradsync_torch.data_parallel import ReduceScatter
from tests.torch.dp_grad_checks import (
    assert_equal,
    batch,
    expect_error,
    grads,
    mlp,
    same_on_all_ranks,
    shard,
    step,
)


def check_batchnorm_buffers(rank: int, ws: int) -> None:
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.GELU(), nn.Linear(8, 3))
    ours = gt.DataParallel(copy.deepcopy(base))
    ddp = DDP(copy.deepcopy(base))
    for s in range(3):
        x, y = batch(s, ws)
        x = x + rank  # ranks see different statistics
        for m in (ours, ddp):
            step(m, x, y, rank)
        assert_equal(grads(ours), grads(ddp), f"step {s} grads vs DDP")
        assert_equal(list(ours.buffers()), list(ddp.buffers()), f"step {s} buffers vs DDP")
    with torch.no_grad():
        ours.eval()(shard(batch(9, ws)[0], rank))  # first forward after training: broadcast
    bn = ours.module[1]
    same_on_all_ranks([bn.running_mean, bn.running_var], "BatchNorm statistics")
    off = gt.DataParallel(copy.deepcopy(base), broadcast_buffers=False)
    x, y = batch(0, ws)
    step(off, x + rank, y, rank)
    step(off, x + rank, y, rank)
    if ws > 1:
        gathered = [torch.empty(8) for _ in range(ws)]
        dist.all_gather(gathered, off.module[1].running_mean)
        assert not torch.equal(gathered[0], gathered[-1]), "broadcast_buffers=False broadcast"


def check_broadcasts(rank: int, ws: int) -> None:
    model = mlp(seed=rank)  # different weights on every rank
    ours = gt.DataParallel(model, param_broadcast_period=2)
    same_on_all_ranks(list(model.parameters()), "parameters after construction")
    expected = [p.detach().clone() for p in mlp(seed=0).parameters()]
    assert_equal(list(model.parameters()), expected, "rank 0's initial weights")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for s in range(4):
        x, y = batch(s, ws)
        step(ours, x, y, rank)
        opt.step()
        with torch.no_grad():  # drift on purpose: only the period broadcast repairs it
            next(model.parameters()).add_(rank * 1e-3)
        ours(shard(x, rank))  # forward after sync s + 1
        if (s + 1) % 2 == 0:
            same_on_all_ranks(list(model.parameters()), f"parameters after sync {s + 1}")


def check_mismatch_fails_fast(rank: int, ws: int) -> None:
    odd = ws - 1  # the last rank builds something else
    others = f"ranks {list(range(odd))} and ranks [{odd}]"
    hidden = 11 if rank == odd else 10
    expect_error(
        ValueError, [others, "parameter #0", "'0.weight'", "(11, 6)"],
        lambda: gt.DataParallel(mlp(hidden=hidden)),
    )  # fmt: skip
    a, b = nn.Linear(4, 4), nn.Linear(4, 3)
    swapped = nn.Sequential(a, b) if rank != odd else nn.Sequential(nn.Linear(4, 3), a)
    expect_error(ValueError, [others, "parameter #0"], lambda: gt.DataParallel(swapped))
    cap = 1.0 if rank == odd else None
    expect_error(
        ValueError, [others, "cap_bytes differs"],
        lambda: gt.DataParallel(mlp(), bucket_cap_mb=cap),
    )  # fmt: skip
    mode = {"reduce": "sum"} if rank == odd else {}
    expect_error(ValueError, [others, "reduce"], lambda: gt.DataParallel(mlp(), **mode))
    model = mlp()
    if rank == odd:
        model[0].bias.requires_grad_(False)
    expect_error(ValueError, [others, "'0.bias'"], lambda: gt.DataParallel(model))
    buffered = mlp()
    buffered.register_buffer("stats", torch.zeros(5 if rank != odd else 6))
    expect_error(ValueError, [others, "buffer stats [5]"], lambda: gt.DataParallel(buffered))
    gt.DataParallel(mlp())  # the group still works after the errors


def check_errors(rank: int, ws: int) -> None:
    expect_error(ValueError, ["reduce must be"], lambda: gt.DataParallel(mlp(), reduce="avg"))
    expect_error(
        ValueError, ["reduce_dtype"], lambda: gt.DataParallel(mlp(), reduce_dtype=torch.int8)
    )
    expect_error(ValueError, ["bucket_cap_mb"], lambda: gt.DataParallel(mlp(), bucket_cap_mb=0))
    expect_error(
        ValueError,
        ["needs overlap=True"],
        lambda: gt.DataParallel(mlp(), overlap=False, gradient_as_bucket_view=True),
    )
    expect_error(TypeError, ["wraps an nn.Module"], lambda: gt.DataParallel(lambda x: x))
    expect_error(
        ValueError,
        ["shard_gradients=True", "gradient_as_bucket_view=False"],
        lambda: gt.DataParallel(mlp(), shard_gradients=True, gradient_as_bucket_view=True),
    )
    expect_error(
        ValueError,
        ["shard_gradients=True", "reduce_dtype=torch.bfloat16"],
        lambda: gt.DataParallel(mlp(), shard_gradients=True, reduce_dtype=torch.bfloat16),
    )
    # A backward that reaches a parameter through neither the wrapper's output nor a bucket's
    # flush hook was never reduced: the next forward says so instead of going on unsynced.
    unnoticed = gt.DataParallel(nn.Linear(3, 2))
    flush = set(unnoticed.reducer.readiness.flush_slots)
    other = next(p for i, p in enumerate(unnoticed.reducer._params) if i not in flush)
    (other * 2).sum().backward()
    expect_error(
        RuntimeError,
        ["without reaching the DataParallel's outputs", "were not reduced"],
        lambda: unnoticed(torch.zeros(1, 3)),
    )
    torch.manual_seed(0)
    sparse = gt.DataParallel(nn.Embedding(10, 4, sparse=True))
    expect_error(
        RuntimeError, ["'weight'", "sparse"], lambda: sparse(torch.tensor([1, 2])).sum().backward()
    )
    double = gt.DataParallel(mlp())
    x, y = batch(0, ws)

    def create_graph() -> None:
        loss = F.mse_loss(double(shard(x, rank)), shard(y, rank))
        loss.backward(create_graph=True)

    expect_error(RuntimeError, ["requires grad", "create_graph"], create_graph)
    double.zero_grad(set_to_none=True)
    step(double, x, y, rank)  # the wrapper recovers from the aborted backward
    fresh = gt.DataParallel(mlp())
    step(fresh, x, y, rank)
    assert_equal(grads(double), grads(fresh), "after an aborted backward")
    if ws > 1:
        solo = dist.new_group([0])
        if rank != 0:
            expect_error(
                ValueError, ["not a member"], lambda: gt.DataParallel(mlp(), process_group=solo)
            )


class _Consumer:
    """Stands in for the ZeRO optimizer: anything that claims a sharder."""


def check_gradient_sharder_link(rank: int, ws: int) -> None:
    """ZeRO-2's explicit link: a sharder nobody claimed refuses to drop gradients silently,
    on every rank and in both modes; one consumer at a time may claim it."""
    assert gt.DataParallel(mlp()).gradient_sharder is None
    x, y = batch(0, ws)
    for overlap in (True, False):
        model = gt.DataParallel(mlp(), shard_gradients=True, overlap=overlap)
        sharder = model.gradient_sharder
        assert isinstance(sharder, ReduceScatter)
        expect_error(
            RuntimeError,
            ["DataParallel(shard_gradients=True) keeps only", "data_parallel=model"],
            lambda model=model: step(model, x, y, rank),
        )
        first = _Consumer()
        sharder.claim(first)
        sharder.claim(first)  # the same consumer again: fine
        expect_error(
            ValueError,
            ["already feeds a _Consumer"],
            lambda sharder=sharder: sharder.claim(_Consumer()),
        )
        syncs = sharder.sync_count
        step(model, x, y, rank)  # claimed: the wrapper recovered from the refused sync
        assert sharder.sync_count == syncs + 1, (sharder.sync_count, syncs)
        assert all(isinstance(p.grad, gt.ShardedGradient) for p in model.parameters()), (
            "ZeRO-2 keeps only shards"
        )
        assert sharder.shards and all(sharder.used.values()), sharder.used
        del first
        gc.collect()
        sharder.claim(_Consumer())  # the first consumer is gone, so another may claim
