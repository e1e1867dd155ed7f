"""Gradient sharding (ZeRO-2, arXiv:1910.02054 §5.2): reduce-scatter a padded bucket.

One collective pattern, two callers: ``FlatLayout.reduce_scatter_gradients`` (the optimizer
on its own, after backward) and ``GradientSharder``, the reducer ``DataParallel`` uses with
``shard_gradients=True`` (during backward, overlapped, through its per-bucket seam).

Rank ``r`` receives elements ``[r * chunk, (r + 1) * chunk)`` of every bucket, exactly
``gradsync_core.plan_flat_shards``'s ownership, so the optimizer's pieces of that range find
their gradients there.
"""

from __future__ import annotations

import dataclasses
import math
import weakref

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import Bucket, BucketPlan, ParamSpec, ShardPlan, plan_flat_shards
from gradsync_torch._collectives import finish_reduce_scatter, reduce_scatter
from gradsync_torch._reducer import BucketBuffers, Reducer
from gradsync_torch._specs import named_parameters


def pad_for_sharding(plan: BucketPlan, world_size: int) -> BucketPlan:
    """``plan`` with every bucket's length rounded up to a multiple of ``world_size`` (the
    membership and offsets stay: only padding is added at the end of each bucket)."""
    multiple = math.lcm(plan.pad_to, world_size)
    buckets = tuple(
        dataclasses.replace(b, numel=-(-b.numel // multiple) * multiple) for b in plan.buckets
    )
    return dataclasses.replace(plan, buckets=buckets, pad_to=multiple)


# Live sharders, so the optimizer can find the DataParallel that reduces its parameters.
_SHARDERS: weakref.WeakSet[GradientSharder] = weakref.WeakSet()


class GradientSharder(Reducer):
    """``DataParallel``'s reducer under ``shard_gradients=True``: each bucket is
    reduce-scattered into a persistent shard on this rank instead of all-reduced, and the
    wrapper drops ``param.grad``; ``ZeroRedundancyOptimizer(shard_gradients=True)`` over the
    same parameters steps the shards.

    Raises:
        ValueError: with ``reduce_dtype`` or ``gradient_as_bucket_view`` (not supported
            with gradient sharding).
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        *,
        reduce: str,
        reduce_dtype: torch.dtype | None,
        data_parallel: nn.Module,
    ) -> None:
        if getattr(data_parallel, "gradient_as_bucket_view", False):
            raise ValueError(
                "shard_gradients=True drops param.grad after each bucket's reduce-scatter, so "
                "gradients cannot be bucket views; leave gradient_as_bucket_view=False"
            )
        if reduce_dtype is not None:
            raise ValueError(
                "shard_gradients=True reduce-scatters in the gradients' dtype; reduce_dtype "
                "is not supported with it"
            )
        super().__init__(group, reduce=reduce, reduce_dtype=None)
        self.rank = dist.get_rank(group)
        self._data_parallel = weakref.ref(data_parallel)
        self.shards: dict[int, torch.Tensor] = {}
        self.synced: tuple[Bucket, ...] = ()  # the buckets of the last completed sync
        self._launched: list[Bucket] = []
        self.used: dict[int, bool] = {}  # id(param) -> some rank had a gradient for it
        self.syncs = 0
        self._consumer: weakref.ref | None = None
        _SHARDERS.add(self)

    def claim(self, consumer: object) -> None:
        """Record ``consumer`` (the ZeRO optimizer) as the one that steps these shards.

        Raises:
            ValueError: if another live consumer claimed this sharder already.
        """
        current = None if self._consumer is None else self._consumer()
        if current is not None and current is not consumer:
            raise ValueError(
                f"this DataParallel(shard_gradients=True) already feeds a "
                f"{type(current).__name__}; each rank's gradient shards can be stepped by one "
                "optimizer only: build one ZeroRedundancyOptimizer per DataParallel"
            )
        self._consumer = weakref.ref(consumer)

    @property
    def data_parallel(self) -> nn.Module:
        dp = self._data_parallel()
        if dp is None:
            raise RuntimeError("the DataParallel that shards these gradients was deleted")
        return dp

    def params_by_name(self) -> dict[str, torch.Tensor]:
        return dict(named_parameters(self.data_parallel.module))

    def plan_for(
        self, params: list[torch.Tensor], specs: list[ParamSpec], groups: list[int]
    ) -> ShardPlan:
        """The flat plan of the wrapper's (padded) buckets, named and grouped as the
        optimizer holding ``params`` (with ``specs`` and param-group indices) names them."""
        from gradsync_torch._zero_flat import rename_plan

        index = {id(p): i for i, p in enumerate(params)}
        mine = {n: index[id(p)] for n, p in self.params_by_name().items() if id(p) in index}
        base = plan_flat_shards(self.data_parallel.bucket_plan, world_size=self.world_size)
        names = {n: specs[i].name for n, i in mine.items()}
        return rename_plan(base, names, {n: groups[i] for n, i in mine.items()})

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        if self.hook is not None:
            raise RuntimeError(
                "a comm hook owns the whole reduction, which shard_gradients=True replaces "
                "by a reduce-scatter; use one or the other"
            )
        spec = bucket.spec
        chunk = spec.numel // self.world_size
        shard = self.shards.get(spec.index)
        if shard is None or shard.numel() != chunk or shard.dtype != bucket.buffer.dtype:
            shard = torch.zeros(chunk, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            self.shards[spec.index] = shard
        if spec.index == 0:
            self._launched = []
        self._launched.append(spec)
        handles = reduce_scatter(bucket.buffer, shard, self.group, self.world_size)
        bucket.handle = (handles, is_last)

    def finish(self, bucket: BucketBuffers) -> None:
        (handles, is_last), bucket.handle = bucket.handle, None
        shard = self.shards[bucket.spec.index]
        finish_reduce_scatter(bucket.buffer, shard, handles, self.group, self.rank, self.world_size)
        if is_last:
            self.synced = tuple(self._launched)
            self.syncs += 1

    def record_used(self, param: torch.Tensor, used: bool) -> None:
        """Called by DataParallel for every parameter after each sync."""
        self.used[id(param)] = used


def find_sharder(params: list[torch.Tensor]) -> GradientSharder | None:
    """The live ``GradientSharder`` whose DataParallel reduces any of ``params``."""
    ids = {id(p) for p in params}
    for sharder in list(_SHARDERS):
        dp = sharder._data_parallel()
        if dp is not None and any(id(p) in ids for _, p in named_parameters(dp.module)):
            return sharder
    return None
