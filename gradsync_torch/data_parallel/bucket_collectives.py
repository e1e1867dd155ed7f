"""How the ``Reducer`` reduces one bucket: a small strategy it is given (DDP's comm-hook seam).

The Reducer owns the buckets and decides *when* each one is staged, launched, waited for
and written back; a ``BucketCollective`` decides *how*:

- ``AllReduce``: divide (the mean) and all-reduce, optionally through a wire dtype;
- ``CommHook``: a user hook with torch DDP's contract owns the whole reduction;
- ``ReduceScatter`` (``grad_sharding.py``, ZeRO-2): reduce-scatter into this rank's shard
  and drop ``param.grad``.

The first two leave the full sum in the bucket and write it back into ``param.grad``
(``FullSum``); the third keeps only its shard, for the ZeRO optimizer that claimed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

from gradsync_torch.data_parallel.buckets import BucketBuffers, GradSlots
from gradsync_torch.data_parallel.comm_hooks import CommHook as HookFn
from gradsync_torch.data_parallel.comm_hooks import GradBucket, in_bucket_order


class BucketCollective(Protocol):
    """The per-bucket verbs the ``Reducer`` calls, in this order within a sync.

    ``chains_collectives``: the collective may issue further collectives after ``launch``
    returns (a hook's future callbacks), so the Reducer issues its own used-map all-reduce
    only once every bucket is finished.
    """

    chains_collectives: bool

    def install(self, buckets: Sequence[BucketBuffers]) -> None:
        """A layout's buckets, at construction and after a rebuild."""

    def divisor(self, bucket: BucketBuffers) -> int | None:
        """Divide the gradients by this while gathering them into ``bucket`` (or not)."""

    def prepare(self, bucket: BucketBuffers) -> None:
        """Before ``bucket``'s gradients are gathered into ``bucket.buffer``."""

    def staged(
        self, bucket: BucketBuffers, copied: list[tuple[nn.Parameter, torch.Tensor]]
    ) -> None:
        """After they were gathered (``copied``: the gradients that were not views)."""

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        """Start reducing ``bucket``; returns before the collective completes."""

    def finish(self, bucket: BucketBuffers) -> None:
        """Wait for ``bucket``'s collective."""

    def write_back(self, bucket: BucketBuffers, present: Sequence[bool]) -> list[int]:
        """Hand the result of the parameters this rank had a gradient for (``present``, by
        slot) back; return the positions of the others, which wait for the used-map."""

    def write_back_absent(
        self, bucket: BucketBuffers, i: int, global_used: Sequence[int] | None
    ) -> None:
        """Hand back position ``i``, a parameter this rank had no gradient for
        (``global_used``: per slot, how many ranks had one)."""

    def reset(self) -> None:
        """A backward is over (synced or abandoned)."""

    def end_sync(self) -> None:
        """A sync completed on every bucket."""


class FullSum:
    """Shared by ``AllReduce`` and ``CommHook``: the bucket ends up holding the full sum,
    which is written back into ``param.grad`` (or left there, for bucket views).

    Args:
        slots: the Reducer's per-parameter flags.
        views: ``gradient_as_bucket_view``: leave ``param.grad`` as a view into its bucket.
    """

    chains_collectives = False

    def __init__(self, slots: GradSlots, *, views: bool) -> None:
        self.slots = slots
        self.views = views

    def install(self, buckets: Sequence[BucketBuffers]) -> None:
        pass

    def divisor(self, bucket: BucketBuffers) -> int | None:
        return None

    def prepare(self, bucket: BucketBuffers) -> None:
        pass

    def staged(
        self, bucket: BucketBuffers, copied: list[tuple[nn.Parameter, torch.Tensor]]
    ) -> None:
        if self.views:
            for param, view in copied:
                param.grad = view  # from now on autograd accumulates in the bucket

    def write_back(self, bucket: BucketBuffers, present: Sequence[bool]) -> list[int]:
        absent: list[int] = []
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        preset = self.slots.preset
        for i, (param, view, slot) in enumerate(
            zip(bucket.params, bucket.views, bucket.slot_ids, strict=True)
        ):
            if not present[slot]:
                absent.append(i)
                continue
            preset[slot] = False
            grad = param.grad
            assert grad is not None  # present: this rank produced the gradient
            if grad.data_ptr() == view.data_ptr():
                continue  # a bucket view already: the reduced value is in place
            if self.views:
                param.grad = view
            else:
                targets.append(grad)
                sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)
        return absent

    def write_back_absent(
        self, bucket: BucketBuffers, i: int, global_used: Sequence[int] | None
    ) -> None:
        slot, param, view = bucket.slot_ids[i], bucket.params[i], bucket.views[i]
        if self.slots.has_grad(slot, param):
            grad = param.grad
            assert grad is not None  # has_grad
            if grad.data_ptr() == view.data_ptr():
                pass  # a bucket view already: the reduced value is in place
            elif self.views:
                param.grad = view
            else:
                grad.copy_(view)
        elif global_used is not None and global_used[slot] > 0:
            # No gradient here but some rank had one: every rank must step the same way.
            param.grad = view if self.views else view.clone()
        else:
            param.grad = None  # no rank had a gradient: as in a single process
        self.slots.preset[slot] = False

    def reset(self) -> None:
        pass

    def end_sync(self) -> None:
        pass


class AllReduce(FullSum):
    """Divide by the group size first (``mean``, in the wire dtype, as DDP and fairseq do, so
    low-precision sums do not overflow; fused into the copy into the bucket when the bucket
    travels in its own dtype), then an asynchronous ``all_reduce``. A bucket with a wire
    buffer (``reduce_dtype``) is cast into it and cast back.
    """

    def __init__(
        self, group: dist.ProcessGroup, slots: GradSlots, *, mean: bool, views: bool
    ) -> None:
        super().__init__(slots, views=views)
        self.group = group
        self.world_size = group.size()
        self.mean = mean

    def divisor(self, bucket: BucketBuffers) -> int | None:
        # Without a wire buffer the mean's division rides on the copy into the bucket (DDP
        # does the same), saving one pass over every gradient.
        return self.world_size if self.mean and bucket.wire is None else None

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        tensor = bucket.buffer
        if bucket.wire is not None:
            # Cast, then divide in the wire dtype: the arithmetic of DDP's compress hooks.
            tensor = bucket.wire.copy_(bucket.buffer)
            if self.mean:
                tensor.div_(self.world_size)
        bucket.handle = dist.all_reduce(tensor, group=self.group, async_op=True)

    def finish(self, bucket: BucketBuffers) -> None:
        handle, bucket.handle = bucket.handle, None
        handle.wait()
        if bucket.wire is not None:
            bucket.buffer.copy_(bucket.wire)


class CommHook(FullSum):
    """``hook(state, bucket) -> Future[Tensor]`` reduces each bucket (DDP's contract): the
    hook owns the whole reduction, and its future's value is copied back into the bucket."""

    # A hook may issue further collectives from its futures' callbacks (PowerSGD), which
    # gloo runs on its own thread.
    chains_collectives = True

    def __init__(self, hook: HookFn, state: Any, slots: GradSlots, *, views: bool) -> None:
        super().__init__(slots, views=views)
        if isinstance(state, PowerSGDState):
            # PowerSGD's chained all-reduces keep one order on every rank only if the buckets
            # reduce one after another; other hooks keep their buckets in flight together.
            hook = in_bucket_order(hook)
        self.hook, self.state = hook, state

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        view = GradBucket(bucket.spec.index, bucket.buffer, bucket.views, bucket.params, is_last)
        bucket.handle = self.hook(self.state, view)

    def finish(self, bucket: BucketBuffers) -> None:
        handle, bucket.handle = bucket.handle, None
        value = handle.wait()
        if isinstance(value, list | tuple):
            value = value[0]
        if not isinstance(value, torch.Tensor) or value.shape != bucket.buffer.shape:
            raise RuntimeError(
                f"the comm hook's future for bucket {bucket.spec.index} returned "
                f"{type(value).__name__} {getattr(value, 'shape', '')}; it must return "
                f"a tensor of shape {tuple(bucket.buffer.shape)} (the reduced bucket)"
            )
        if value.data_ptr() != bucket.buffer.data_ptr():
            bucket.buffer.copy_(value)
