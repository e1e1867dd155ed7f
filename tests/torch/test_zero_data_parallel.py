"""ZeRO-2 as an option of gradsync DataParallel (``DataParallel(shard_gradients=True)``).

The checks run inside the world-size workers of ``test_zero.py`` (2 and 4 ranks); the tests
here need no processes. The optimizer is linked to the wrapper explicitly
(``ZeroRedundancyOptimizer(..., shard_gradients=True, data_parallel=model)``); the unclaimed
case is ``check_explicit_link`` here and ``check_gradient_sharder_link`` in ``dp_setup_checks``.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync_core import ParamSpec, plan_buckets
from gradsync_torch import DataParallel, ShardedGradient, ZeroRedundancyOptimizer
from gradsync_torch.data_parallel.grad_sharding import POOL_BUFFERS, pad_for_sharding
from tests.support.harness import run_workers
from tests.torch.zero_helpers import Pair, batch, make_model, same


def check_data_parallel(world_size: int, directory: str) -> None:
    """ZeRO-2 as an option of DataParallel: gradients are reduce-scattered during backward
    (param.grad dropped, each rank holds its shard), and the run equals DataParallel +
    plain Adam, accumulation under no_sync() included. Its checkpoint loads into ZeRO-1."""
    rank = dist.get_rank()
    check_explicit_link(world_size, rank)
    check_unused_on_some_ranks(world_size, rank)
    model = make_model()
    ref_model = copy.deepcopy(model)
    sharded = DataParallel(model, shard_gradients=True, bucket_cap_mb=0.002)
    plain_dp = DataParallel(ref_model, bucket_cap_mb=0.002)
    with pytest.raises(ValueError, match=r"pass shard_gradients=True with it"):
        ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, data_parallel=sharded)
    with pytest.raises(ValueError, match=r"built without shard_gradients=True"):
        ZeroRedundancyOptimizer(
            ref_model.parameters(), torch.optim.Adam, shard_gradients=True, data_parallel=plain_dp
        )
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(),
        torch.optim.Adam,
        lr=1e-2,
        shard_gradients=True,
        data_parallel=sharded,
    )
    assert sharded.gradient_sharder is not None and plain_dp.gradient_sharder is None
    with pytest.raises(ValueError, match=r"already feeds a ZeroRedundancyOptimizer"):
        ZeroRedundancyOptimizer(
            model.parameters(), torch.optim.Adam, shard_gradients=True, data_parallel=sharded
        )
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    assert len(sharded.bucket_plan.buckets) > 1
    assert all(b.numel % world_size == 0 for b in sharded.bucket_plan.buckets)
    exact = world_size <= 2
    for step in range(8):
        opt.zero_grad()
        ref.zero_grad()
        for micro in range(2 if step % 3 == 2 else 1):  # every third step accumulates
            x, y = batch(10 * step + micro, world_size, rank)
            for wrapper in (sharded, plain_dp):
                if micro == 0 and step % 3 == 2:
                    with wrapper.no_sync():
                        F.mse_loss(wrapper(x), y).backward()
                else:
                    F.mse_loss(wrapper(x), y).backward()
        assert all(isinstance(p.grad, ShardedGradient) for p in model.parameters()), (
            "ZeRO-2 keeps only shards"
        )
        assert 0 < opt.grad_nbytes() <= 4 * sum(p.numel() for p in model.parameters())
        check_pool_memory(sharded)
        opt.step()
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            same(p.detach(), q.detach(), exact, f"DataParallel ZeRO-2 step {step} {name}")
    pair = Pair(world_size, lambda m: opt, lambda m: ref, model=model)
    pair.exact = exact
    pair.check_state()
    path = os.path.join(directory, f"dp-zero2-{world_size}")
    opt.save(path)
    other = ZeroRedundancyOptimizer(
        copy.deepcopy(model).named_parameters(), torch.optim.Adam, lr=1.0
    )
    other.load(path)
    for to in range(world_size):
        opt.consolidate_state_dict(to)
        mine = opt.state_dict() if rank == to else None
        other.consolidate_state_dict(to)
        if rank == to:
            theirs = other.state_dict()
            assert mine["param_groups"] == theirs["param_groups"]
            for index, state in mine["state"].items():
                for key, value in state.items():
                    assert torch.equal(value, theirs["state"][index][key]), (index, key)


def check_pool_memory(wrapper: DataParallel) -> None:
    """Overlap-mode ZeRO-2 holds at most POOL_BUFFERS bucket buffers at once, measured by its
    pool, not one buffer per bucket (ZeRO-2's 1/N of the gradients plus a constant)."""
    sharder = wrapper.gradient_sharder
    assert sharder is not None and sharder.pool is not None
    bucket_nbytes = [4 * b.numel for b in wrapper.bucket_plan.buckets]
    assert len(bucket_nbytes) > POOL_BUFFERS, "the check needs more buckets than buffers"
    bound = POOL_BUFFERS * max(bucket_nbytes)
    peak = sharder.pool.peak_nbytes
    assert 0 < peak <= bound and peak < sum(bucket_nbytes), (peak, bound, sum(bucket_nbytes))
    assert not any(sharder.pool.holds(b) for b in wrapper.reducer.buckets), (
        "all returned after sync"
    )


class SometimesBranch(nn.Module):
    """``make_model()``, plus a layer that only odd ranks use: on even ranks its bucket never
    completes during backward, so the buckets after it are staged out of order (the pool
    lends them buffers of their own) and it is filled with zeros at the sync."""

    def __init__(self, use_extra: bool) -> None:
        super().__init__()
        self.extra = nn.Linear(16, 8)  # registered first: its bucket is the last in plan order
        self.main = make_model()
        self.use_extra = use_extra

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.main(x) + self.extra(x) if self.use_extra else self.main(x)


def check_unused_on_some_ranks(world_size: int, rank: int) -> None:
    """ZeRO-2 with a layer some ranks leave unused equals DataParallel + plain Adam."""
    torch.manual_seed(1)
    model = SometimesBranch(use_extra=rank % 2 == 1)
    ref_model = copy.deepcopy(model)
    sharded = DataParallel(model, shard_gradients=True, bucket_cap_mb=0.001)
    plain_dp = DataParallel(ref_model, bucket_cap_mb=0.001)
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(),
        torch.optim.Adam,
        lr=1e-2,
        shard_gradients=True,
        data_parallel=sharded,
    )
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = batch(step, world_size, rank)
        for wrapper, optimizer in ((sharded, opt), (plain_dp, ref)):
            optimizer.zero_grad()
            F.mse_loss(wrapper(x), y).backward()
            optimizer.step()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            same(p.detach(), q.detach(), world_size <= 2, f"unused on even ranks, {name}")


def check_explicit_link(world_size: int, rank: int) -> None:
    """The optimizer finds DataParallel's shards only through ``data_parallel=``: one built
    without it leaves the sharder unclaimed, and the first synced backward raises on every
    rank (the shards would otherwise never be stepped) instead of dropping the gradients."""
    model = make_model()
    wrapped = DataParallel(model, shard_gradients=True, bucket_cap_mb=0.002)
    ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, shard_gradients=True)
    x, y = batch(0, world_size, rank)
    with wrapped.no_sync():  # nothing is reduced under no_sync, so nothing is lost yet
        F.mse_loss(wrapped(x), y).backward()
    unclaimed = r"DataParallel\(shard_gradients=True\) keeps only .* data_parallel=model\)"
    with pytest.raises(RuntimeError, match=unclaimed):
        F.mse_loss(wrapped(x), y).backward()


def test_pad_for_sharding_only_pads() -> None:
    specs = [ParamSpec(name=f"w{i}", shape=(5 + i,)) for i in range(5)]
    plan = plan_buckets(specs, cap_bytes=40)
    padded = pad_for_sharding(plan, 4)
    assert [b.numel % 4 for b in padded.buckets] == [0] * len(plan.buckets)
    assert [b.slots for b in padded.buckets] == [b.slots for b in plan.buckets]
    assert padded.pad_to == 4
    assert padded == plan_buckets(specs, cap_bytes=40, pad_to=4)


def _zero2_worker(rank: int, world_size: int, directory: str) -> None:
    check_data_parallel(world_size, directory)


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_zero2_through_data_parallel_matches_plain_adam(world_size: int, tmp_path: Any) -> None:
    run_workers(_zero2_worker, world_size, str(tmp_path), timeout=300)
