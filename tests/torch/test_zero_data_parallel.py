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

from gradsync_core import ParamSpec, plan_buckets
from gradsync_torch import DataParallel, ZeroRedundancyOptimizer
from gradsync_torch.data_parallel.grad_sharding import pad_for_sharding
from tests.torch.harness import run_workers
from tests.torch.zero_helpers import Pair, batch, make_model, same


def check_data_parallel(world_size: int, directory: str) -> None:
    """ZeRO-2 as an option of DataParallel: gradients are reduce-scattered during backward
    (param.grad dropped, each rank holds its shard), and the run equals DataParallel +
    plain Adam, accumulation under no_sync() included. Its checkpoint loads into ZeRO-1."""
    rank = dist.get_rank()
    check_explicit_link(world_size, rank)
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
        assert all(p.grad is None for p in model.parameters()), "ZeRO-2 keeps only shards"
        assert 0 < opt.grad_nbytes() <= 4 * sum(p.numel() for p in model.parameters())
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


@pytest.mark.parametrize("world_size", [2, 4])
def test_zero2_through_data_parallel_matches_plain_adam(world_size: int, tmp_path: Any) -> None:
    run_workers(_zero2_worker, world_size, str(tmp_path), timeout=300)
