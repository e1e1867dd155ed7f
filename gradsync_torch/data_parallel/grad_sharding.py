"""Gradient sharding (ZeRO-2, arXiv:1910.02054 §5.2): reduce-scatter a padded bucket.

One collective pattern, two callers: ``FlatLayout.reduce_scatter_gradients`` (the optimizer
on its own, after backward) and ``ReduceScatter``, the bucket collective ``DataParallel``'s
``Reducer`` is given with ``shard_gradients=True`` (during backward, overlapped, through the
same per-bucket verbs as the all-reduce: ``bucket_collectives.BucketCollective``).

Rank ``r`` receives elements ``[r * chunk, (r + 1) * chunk)`` of every bucket, exactly
``gradsync_core.plan_flat_shards``'s ownership, so the optimizer's pieces of that range find
their gradients there. The link to the optimizer is explicit: the user passes the wrapper
(``ZeroRedundancyOptimizer(..., shard_gradients=True, data_parallel=model)``), and the
optimizer ``claim``s ``model.gradient_sharder``. A sharder nobody claimed refuses to finish a
sync, so gradients are never dropped silently. After a sync ``param.grad`` of every parameter
some rank computed a gradient for is a ``ShardedGradient`` (``sharded_grad.py``): reading it
raises, naming ``opt.clip_grad_norm_``, where ``None`` would read as "no gradient".
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import Bucket, BucketPlan
from gradsync_torch._collectives import reduce_scatter_into
from gradsync_torch.data_parallel.buckets import BucketBuffers, GradSlots
from gradsync_torch.data_parallel.sharded_grad import ShardedGradient

UNCLAIMED_MESSAGE = (
    "DataParallel(shard_gradients=True) keeps only each rank's gradient shard, and no "
    "optimizer was given it, so these gradients would be lost; build "
    "ZeroRedundancyOptimizer(model.parameters(), ..., shard_gradients=True, "
    "data_parallel=model) before the first backward"
)


def pad_for_sharding(plan: BucketPlan, world_size: int) -> BucketPlan:
    """``plan`` with every bucket's length rounded up to a multiple of ``world_size`` (the
    membership and offsets stay: only padding is added at the end of each bucket)."""
    return plan.padded(world_size)


# Bucket buffers a ZeRO-2 rank keeps alive at once in overlap mode (per dtype and device). The
# Reducer copies a bucket's gradients in only once all of them arrived, so while one bucket is
# reduce-scattered out of the buffer the next one fills up in param.grad: one buffer keeps the
# rank at 1/N of the gradients plus two buckets (ZeRO-2's "1/N plus a constant"). A second
# buffer would only help if the backward of a bucket were faster than its collective.
POOL_BUFFERS = 1


class BucketPool:
    """``size`` reusable bucket-sized buffers, each lent to one bucket at a time.

    A bucket borrows a buffer when it is staged and returns it once its reduce-scatter is
    finished (its sum then lives in its shard). If every buffer is lent to a bucket that has
    not been launched yet (gradients arriving out of plan order), the bucket gets a buffer of
    its own for that step rather than wait for a collective nobody started.
    """

    def __init__(self, size: int = POOL_BUFFERS) -> None:
        self.size = size
        self.buffers: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        self.lent: dict[tuple[torch.dtype, torch.device], list[BucketBuffers | None]] = {}
        self.extra: dict[int, torch.Tensor] = {}  # bucket index -> its own buffer, this step
        self.views: dict[tuple[int, int], tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}
        self.peak_nbytes = 0

    def nbytes(self) -> int:
        tensors = [*self.extra.values(), *(b for bs in self.buffers.values() for b in bs)]
        return sum(t.untyped_storage().nbytes() for t in tensors)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.extra.values(), *(b for bs in self.buffers.values() for b in bs)]

    def lend(
        self, bucket: BucketBuffers, numel: int, finish: Callable[[BucketBuffers], None]
    ) -> None:
        """Point ``bucket.buffer`` and ``bucket.views`` at a free buffer of ``numel`` elements or
        more, first finishing the earliest launched borrower if none is free."""
        dtype, device = bucket.params[0].dtype, bucket.params[0].device
        key = (dtype, device)
        lent = self.lent.setdefault(key, [None] * self.size)
        while None not in lent:
            launched = [b for b in lent if b is not None and b.handle is not None]
            if not launched:
                break
            finish(min(launched, key=lambda b: b.spec.index))  # returns its buffer
        index = bucket.spec.index
        if None in lent:
            slot = lent.index(None)
            pool = self.buffers.setdefault(key, [])
            while len(pool) <= slot:
                pool.append(torch.empty(0, dtype=dtype, device=device))
            if pool[slot].numel() < numel:
                pool[slot] = torch.empty(numel, dtype=dtype, device=device)
                self.views = {k: v for k, v in self.views.items() if k[1] != slot}
            lent[slot] = bucket
            cached = self.views.get((index, slot))
            if cached is None or cached[0].untyped_storage().data_ptr() != (
                pool[slot].untyped_storage().data_ptr()
            ):
                cached = _views_of(bucket, pool[slot][:numel])
                self.views[(index, slot)] = cached
        else:
            self.extra[index] = torch.empty(numel, dtype=dtype, device=device)
            cached = _views_of(bucket, self.extra[index])
        bucket.buffer, bucket.views = cached
        _zero_gaps(bucket)
        self.peak_nbytes = max(self.peak_nbytes, self.nbytes())

    def give_back(self, bucket: BucketBuffers) -> None:
        """``bucket``'s collective is finished: its buffer is free again."""
        if self.extra.pop(bucket.spec.index, None) is not None:
            bucket.buffer, bucket.views = _NO_BUFFER, ()
        for lent in self.lent.values():
            for slot, borrower in enumerate(lent):
                if borrower is bucket:
                    lent[slot] = None

    def holds(self, bucket: BucketBuffers) -> bool:
        return bucket.spec.index in self.extra or any(
            borrower is bucket for lent in self.lent.values() for borrower in lent
        )

    def forget(self) -> None:
        """A backward was abandoned: every buffer is free."""
        self.extra.clear()
        for lent in self.lent.values():
            lent[:] = [None] * self.size


_NO_BUFFER = torch.empty(0)


def _views_of(
    bucket: BucketBuffers, buffer: torch.Tensor
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    views = tuple(buffer[s.offset : s.offset + s.numel].view(s.shape) for s in bucket.spec.slots)
    return buffer[: bucket.spec.numel], views


def _zero_gaps(bucket: BucketBuffers) -> None:
    """Zero what no gradient is copied into (alignment gaps, the padding): a reused buffer
    holds another bucket's values there, which would be summed into the shard."""
    end = 0
    for slot in bucket.spec.slots:
        if slot.offset > end:
            bucket.buffer[end : slot.offset].zero_()
        end = slot.offset + slot.numel
    if end < bucket.spec.numel:
        bucket.buffer[end:].zero_()


class ReduceScatter:
    """``DataParallel``'s bucket collective under ``shard_gradients=True`` (a
    ``BucketCollective``): each bucket is reduce-scattered into a persistent shard on this
    rank instead of all-reduced, and ``param.grad`` is dropped; the
    ``ZeroRedundancyOptimizer`` that ``claim``ed it steps the shards. The layout stays fixed
    (no rebuild): it is the optimizer's ownership.

    What the optimizer reads: ``world_size``, ``shards`` (bucket index -> this rank's summed
    chunk), ``last_sync_buckets`` (the buckets of the last completed sync), ``used``
    (``id(param)`` -> some rank had a gradient for it), ``sync_count`` (completed syncs) and
    ``params_by_name()``. After a sync ``param.grad`` is a ``ShardedGradient`` where ``used``
    (``None`` elsewhere, as after DDP's sync); ``drop_placeholders()`` clears them.

    Args:
        group: the data-parallel process group.
        slots: the Reducer's per-parameter flags.
        mean: divide by the group size (while gathering the gradients into the bucket).
        overlap: overlap mode: bucket buffers come from a small pool (``BucketPool``), so
            the rank keeps 1/N of the gradients plus ``POOL_BUFFERS`` buckets; legacy mode
            shares one buffer already.
        module_params: every parameter of the wrapped module by name (frozen ones too),
            which the optimizer maps to its own names.
    """

    chains_collectives = False

    def __init__(
        self,
        group: dist.ProcessGroup,
        slots: GradSlots,
        *,
        mean: bool,
        overlap: bool,
        module_params: dict[str, nn.Parameter],
    ) -> None:
        self.group = group
        self.world_size = group.size()
        self.rank = dist.get_rank(group)
        self.slots = slots
        self.mean = mean
        self.pool = BucketPool() if overlap else None
        self._module_params = dict(module_params)
        self._names = {id(p): name for name, p in self._module_params.items()}
        self._placeholders: dict[int, ShardedGradient] = {}
        self.shards: dict[int, torch.Tensor] = {}
        self.last_sync_buckets: tuple[Bucket, ...] = ()
        self._launched: list[Bucket] = []
        self._buckets: Sequence[BucketBuffers] = ()
        self.used: dict[int, bool] = {}
        self.sync_count = 0
        self._consumer: Callable[[], object | None] | None = None

    def claim(self, consumer: object) -> None:
        """Record ``consumer`` (the ZeRO optimizer) as the one that steps these shards.

        Claiming again with the same consumer is a no-op; once a consumer is garbage
        collected, another may claim.

        Raises:
            ValueError: if another live consumer claimed this sharder already.
        """
        current = None if self._consumer is None else self._consumer()
        if current is not None and current is not consumer:
            raise ValueError(
                f"this DataParallel(shard_gradients=True) already feeds a "
                f"{type(current).__name__} (id {id(current):#x}); each rank's gradient shards "
                f"can be stepped by one optimizer only, not also by this "
                f"{type(consumer).__name__}: build one ZeroRedundancyOptimizer per DataParallel"
            )
        try:
            self._consumer = weakref.ref(consumer)
        except TypeError:  # not weakly referenceable: hold it for the sharder's lifetime
            self._consumer = lambda: consumer

    @property
    def claimed(self) -> bool:
        return self._consumer is not None and self._consumer() is not None

    def drop_placeholders(self) -> None:
        """Set ``param.grad`` to ``None`` where it holds this sharder's placeholder."""
        for param in self._module_params.values():
            if isinstance(param.grad, ShardedGradient):
                param.grad = None

    def params_by_name(self) -> dict[str, torch.Tensor]:
        """Every parameter of the wrapped module by name (the names in the bucket plan)."""
        return dict(self._module_params)

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Every gradient buffer this sharder holds now: the pool (or the buckets' shared
        buffer) and the shards."""
        if self.pool is not None:
            held = self.pool.tensors()
        else:
            held = [b.buffer for b in self._buckets]
        return [*held, *self.shards.values()]

    # ---- the BucketCollective verbs -----------------------------------------------------

    def install(self, buckets: Sequence[BucketBuffers]) -> None:
        self._buckets = buckets
        if self.pool is not None:
            for bucket in buckets:  # a buffer is lent when the bucket is staged
                bucket.buffer, bucket.views = _NO_BUFFER, ()

    def divisor(self, bucket: BucketBuffers) -> int | None:
        return self.world_size if self.mean else None

    def prepare(self, bucket: BucketBuffers) -> None:
        if self.pool is not None:
            self.pool.lend(bucket, bucket.spec.numel, self.finish)

    def staged(
        self, bucket: BucketBuffers, copied: list[tuple[nn.Parameter, torch.Tensor]]
    ) -> None:
        # The bucket holds a fired gradient until the reduce-scatter; one accumulated under
        # no_sync stays until the write-back reads it.
        fired = self.slots.fired
        for param, slot in zip(bucket.params, bucket.slot_ids, strict=True):
            if fired[slot]:
                param.grad = None

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        spec = bucket.spec
        chunk = spec.numel // self.world_size
        shard = self.shards.get(spec.index)
        if shard is None or shard.numel() != chunk or shard.dtype != bucket.buffer.dtype:
            shard = torch.zeros(chunk, dtype=bucket.buffer.dtype, device=bucket.buffer.device)
            self.shards[spec.index] = shard
        if spec.index == 0:
            self._launched = []
        self._launched.append(spec)
        bucket.handle = reduce_scatter_into(shard, bucket.buffer, self.group, tag=spec.index)

    def finish(self, bucket: BucketBuffers) -> None:
        if bucket.handle is None and self.pool is not None and not self.pool.holds(bucket):
            return  # finished early, to lend its buffer to a later bucket
        handle, bucket.handle = bucket.handle, None
        handle.wait()
        if self.pool is not None:
            self.pool.give_back(bucket)

    def write_back(self, bucket: BucketBuffers, present: Sequence[bool]) -> list[int]:
        absent = []
        for i, slot in enumerate(bucket.slot_ids):
            if present[slot]:
                self._keep_used(bucket, i, None)
            else:
                absent.append(i)
        return absent

    def write_back_absent(
        self, bucket: BucketBuffers, i: int, global_used: Sequence[int] | None
    ) -> None:
        self._keep_used(bucket, i, global_used)

    def _keep_used(self, bucket: BucketBuffers, i: int, global_used: Sequence[int] | None) -> None:
        # ZeRO-2: this rank's shard of the sum is in ``shards``; only the used-map is kept.
        slot, param = bucket.slot_ids[i], bucket.params[i]
        used = self.slots.has_grad(slot, param)
        used = self.used[id(param)] = used or (global_used is not None and global_used[slot] > 0)
        param.grad = self._placeholder(param) if used else None
        self.slots.preset[slot] = False

    def _placeholder(self, param: nn.Parameter) -> ShardedGradient:
        placeholder = self._placeholders.get(id(param))
        if placeholder is None:
            name = self._names.get(id(param), "a parameter")
            placeholder = self._placeholders[id(param)] = ShardedGradient(param, name)
        return placeholder

    def reset(self) -> None:
        if self.pool is not None:
            self.pool.forget()

    def end_sync(self) -> None:
        self.last_sync_buckets = tuple(self._launched)
        self.sync_count += 1
        # Every rank reaches this point after the same collectives, so each raises here
        # without leaving another rank waiting in one.
        if not self.claimed:
            raise RuntimeError(UNCLAIMED_MESSAGE)
