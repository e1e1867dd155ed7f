"""The ``Reducer``: owns every piece of bucket state and every gradient collective of a step.

``DataParallel`` decides *when* (a gradient became ready, the backward finished, the user
called ``sync_gradients()``); the Reducer decides *what* and *how*, the way DDP's Python wrapper
drives its C++ ``Reducer``. The wrapper talks to it through a few verbs:

- ``mark_ready(slot)``: a gradient arrived in a synced backward. It only counts (on a GPU
  the hook thread also launches the backward kernels); a complete bucket is staged in one
  batch and launched in plan order (arXiv:2006.15704: the same order on every rank).
- ``mark_accumulated(slot)``: a gradient arrived under ``no_sync()``; nothing to reduce yet.
- ``sync_overlap()`` / ``sync_legacy()``: after backward, reduce what is left, write the
  averages back into ``param.grad`` and reset for the next step (docs/design.md §7).
- ``rebuild()`` (once: rank 0's gradient-ready order), ``bind_views()``, ``abandon()``.

Besides the buckets it issues the used-map all-reduce (carrying the runtime agreement check)
and the rebuild broadcast, on CPU tensors over gloo (``used_map.py``). ``GradientSharder``
(``grad_sharding.py``) swaps the collective (``launch`` / ``finish``) and the write-back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._collectives import global_rank
from gradsync_torch.data_parallel.buckets import (
    PER_TENSOR_DIVISION_MIN_NUMEL,
    BucketBuffers,
    build_buckets,
    gather_gradients,
)
from gradsync_torch.data_parallel.comm_hooks import CommHook, GradBucket
from gradsync_torch.data_parallel.sync_agreement import SyncRecord, layout_fingerprint
from gradsync_torch.data_parallel.used_map import UsedMap
from gradsync_torch.data_parallel.used_map import bookkeeping_group as make_bookkeeping_group


class Reducer:
    """Bucket state and the per-bucket collective over the data-parallel group.

    Without a comm hook: divide by the group size first (``reduce="mean"``, in the reduce
    dtype, as DDP and fairseq do, so low-precision sums do not overflow; fused into the copy
    into the bucket when the wire dtype is the gradients'), then an asynchronous
    ``all_reduce``; with ``reduce_dtype`` the bucket travels in a persistent wire buffer of
    that dtype and is cast back. With a comm hook, the hook owns the reduction (DDP's
    contract) and its future's value is copied back into the bucket.

    Args:
        group: the data-parallel process group.
        trainable: ``(name, parameter)`` of every trainable parameter; a parameter's
            position is its *slot*.
        specs: the specs of every parameter (frozen ones too), for rebuilding the plan.
        plan: the initial bucket layout.
        bookkeeping_group: a gloo group over the same ranks, for the used-map and the
            rebuild broadcast on CPU tensors; ``None``: ``used_map.bookkeeping_group(group)``.
        reduce: ``"mean"`` or ``"sum"``.
        reduce_dtype: the dtype on the wire, ``None`` for the gradients' own.
        overlap: one buffer per bucket (``True``) or fairseq's one reused buffer.
        gradient_as_bucket_view: leave ``param.grad`` as a view into its bucket.
        record_ready_order: observe the first synced backward's ready order for ``rebuild``.
    """

    keeps_param_grads = True  # ZeRO-2's sharder keeps only its shard instead

    def __init__(
        self,
        group: dist.ProcessGroup,
        trainable: Sequence[tuple[str, nn.Parameter]],
        specs: Sequence[gradsync_core.ParamSpec],
        plan: gradsync_core.BucketPlan,
        *,
        bookkeeping_group: dist.ProcessGroup | None = None,
        reduce: str,
        reduce_dtype: torch.dtype | None,
        overlap: bool,
        gradient_as_bucket_view: bool,
        record_ready_order: bool,
    ) -> None:
        self.group = group
        self.world_size = group.size()
        self.mean = reduce == "mean"
        self.reduce_dtype = reduce_dtype
        self.overlap = overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.hook: CommHook | None = None
        self.hook_state: Any = None
        self._names = [name for name, _ in trainable]
        self._params = [p for _, p in trainable]
        self._specs = list(specs)
        if bookkeeping_group is None:
            bookkeeping_group = make_bookkeeping_group(group)
        self._used_map = UsedMap(bookkeeping_group)
        self._group_src = global_rank(bookkeeping_group, 0)
        n = len(self._params)
        self._fired = [False] * n  # gradient arrived in this synced backward
        self._preset = [False] * n  # grad is a zeroed bucket view we bound, not a gradient
        self._next_launch = 0  # the first bucket not launched yet in this backward
        self._ready_order: list[int] | None = [] if record_ready_order else None
        self._install(plan)

    def _install(self, plan: gradsync_core.BucketPlan) -> None:
        self.plan = plan
        self.layout = layout_fingerprint(plan)  # for the runtime agreement check
        slot_of = {name: i for i, name in enumerate(self._names)}
        self.buckets = build_buckets(
            plan,
            dict(zip(self._names, self._params, strict=True)),
            slot_of,
            reduce_dtype=self.reduce_dtype,
            shared=not self.overlap,
        )
        self._bucket_of = [self.buckets[0]] * len(self._params) if self.buckets else []
        for bucket in self.buckets:
            for slot in bucket.slot_ids:
                self._bucket_of[slot] = bucket
        self._per_tensor_division = [
            b.buffer.device.type == "cpu"
            and b.spec.numel >= PER_TENSOR_DIVISION_MIN_NUMEL * len(b.params)
            for b in self.buckets
        ]

    # ---- how one bucket is reduced ----------------------------------------------------

    def set_comm_hook(self, hook: CommHook, state: Any) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` from now on (DDP's contract)."""
        self.hook, self.hook_state = hook, state

    @property
    def divides_on_copy(self) -> bool:
        # Without a hook or a wire dtype the mean's division rides on the copy into the
        # bucket (DDP does the same), saving one pass over every gradient.
        return self.mean and self.hook is None and self.reduce_dtype is None

    def stage(self, bucket: BucketBuffers) -> None:
        """Put every gradient of ``bucket`` into its slot, divided where that is due.

        A parameter without a gradient contributes zeros; one whose gradient is its bucket
        view already is only divided. The gradients are checked here, once per bucket, so
        the per-gradient hook stays a counter.

        Raises:
            RuntimeError: for a sparse gradient or one that requires grad.
        """
        divisor = self.world_size if self.divides_on_copy else None
        per_tensor = self._per_tensor_division[bucket.spec.index]
        copied = gather_gradients(bucket, self._names, divisor=divisor, per_tensor=per_tensor)
        if not self.keeps_param_grads:
            # ZeRO-2: the bucket holds a fired gradient until the reduce-scatter; one
            # accumulated under no_sync stays until the write-back reads it.
            for param, slot in zip(bucket.params, bucket.slot_ids, strict=True):
                if self._fired[slot]:
                    param.grad = None
        elif self.gradient_as_bucket_view:
            for param, view in copied:
                param.grad = view  # from now on autograd accumulates in the bucket

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        """Start reducing ``bucket.buffer``; returns before the collective completes."""
        if self.hook is not None:
            view = GradBucket(
                bucket.spec.index, bucket.buffer, bucket.views, bucket.params, is_last
            )
            bucket.handle = self.hook(self.hook_state, view)
            return
        tensor = bucket.buffer
        if bucket.wire is not None:
            # Cast, then divide in the wire dtype: the arithmetic of DDP's compress hooks.
            tensor = bucket.wire.copy_(bucket.buffer)
            if self.mean:
                tensor.div_(self.world_size)
        bucket.handle = dist.all_reduce(tensor, group=self.group, async_op=True)

    def finish(self, bucket: BucketBuffers) -> None:
        """Wait for ``bucket``'s collective; the reduced values are then in ``bucket.buffer``."""
        handle, bucket.handle = bucket.handle, None
        if self.hook is not None:
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
            return
        handle.wait()
        if bucket.wire is not None:
            bucket.buffer.copy_(bucket.wire)

    # ---- during backward (the hot path: per parameter, so it only counts) ---------------

    def mark_accumulated(self, slot: int) -> None:
        """A gradient accumulated under ``no_sync()``: it is a real gradient from now on."""
        self._preset[slot] = False

    def mark_ready(self, slot: int) -> None:
        """The trainable parameter ``slot`` has its gradient for this synced backward.

        Raises:
            RuntimeError: if the same parameter reports twice in one backward.
        """
        if self._fired[slot]:
            raise RuntimeError(
                f"parameter {self._names[slot]!r} received its gradient twice in one "
                "backward (reentrant checkpointing?); use "
                "torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self._fired[slot] = True
        if self._ready_order is not None:
            self._ready_order.append(slot)
        bucket = self._bucket_of[slot]
        bucket.pending -= 1
        if bucket.pending == 0:
            self.stage(bucket)
            self._launch_complete()

    def _launch_complete(self) -> None:
        """Launch every staged bucket from the first unlaunched one on, in plan order."""
        buckets, last = self.buckets, len(self.buckets) - 1
        while self._next_launch <= last and buckets[self._next_launch].pending == 0:
            self.launch(buckets[self._next_launch], is_last=self._next_launch == last)
            self._next_launch += 1

    # ---- after backward ---------------------------------------------------------------

    def _has_grad(self, slot: int, param: torch.Tensor) -> bool:
        return self._fired[slot] or (param.grad is not None and not self._preset[slot])

    def _write_back(self, bucket: BucketBuffers, i: int, global_used: Sequence[int] | None) -> None:
        """Leave the reduced value of ``bucket``'s ``i``-th parameter in its ``.grad``
        (per parameter: for parameters this rank had no gradient for, and for ZeRO-2)."""
        slot, param, view = bucket.slot_ids[i], bucket.params[i], bucket.views[i]
        if self._has_grad(slot, param):
            if param.grad.data_ptr() == view.data_ptr():
                pass  # a bucket view already: the reduced value is in place
            elif self.gradient_as_bucket_view:
                param.grad = view
            else:
                param.grad.copy_(view)
        elif global_used is not None and global_used[slot] > 0:
            # No gradient here but some rank had one: every rank must step the same way.
            param.grad = view if self.gradient_as_bucket_view else view.clone()
        else:
            param.grad = None  # no rank had a gradient: as in a single process
        self._preset[slot] = False

    def _write_back_present(self, bucket: BucketBuffers, flags: list[bool]) -> list[int]:
        """Write back every parameter of ``bucket`` this rank had a gradient for, in one
        batch; return the positions of the others (they wait for the used-map)."""
        if not self.keeps_param_grads:
            absent = []
            for i, slot in enumerate(bucket.slot_ids):
                if flags[slot]:
                    self._write_back(bucket, i, None)
                else:
                    absent.append(i)
            return absent
        absent, targets, sources = [], [], []
        preset = self._preset
        for i, (param, view, slot) in enumerate(
            zip(bucket.params, bucket.views, bucket.slot_ids, strict=True)
        ):
            if not flags[slot]:
                absent.append(i)
                continue
            preset[slot] = False
            grad = param.grad
            if grad.data_ptr() == view.data_ptr():
                continue  # a bucket view already: the reduced value is in place
            if self.gradient_as_bucket_view:
                param.grad = view
            else:
                targets.append(grad)
                sources.append(view)
        if targets:
            torch._foreach_copy_(targets, sources)
        return absent

    def _present_flags(self) -> list[bool]:
        """Per slot, whether this rank has a gradient to contribute in this sync."""
        if all(self._fired):
            return self._fired
        return [self._has_grad(s, p) for s, p in enumerate(self._params)]

    def sync_legacy(self, record: SyncRecord | None = None) -> None:
        """Legacy mode: the buckets share one buffer, so each is filled, reduced and written
        back before the next (fairseq's ``LegacyDistributedDataParallel``). ``record``: how
        this rank reached the sync, checked against every rank's (``sync_agreement.py``)."""
        flags = self._present_flags()
        self._used_map.start(flags, record)
        self._used_map.check_agreement()  # before any bucket: a mismatch moves no gradient
        global_used = None if all(flags) else self._used_map.counts().tolist()
        last = len(self.buckets) - 1
        for bucket in self.buckets:
            self.stage(bucket)
            self.launch(bucket, is_last=bucket.spec.index == last)
            self.finish(bucket)
            for i in self._write_back_present(bucket, flags):
                self._write_back(bucket, i, global_used)
        self._end_sync(None)

    def sync_overlap(self, record: SyncRecord | None = None) -> None:
        """Overlap mode: launch the buckets backward left behind (missing gradients count as
        zeros), wait for every bucket, check ``record`` (as in ``sync_legacy``), write back."""
        flags = self._present_flags()
        last = len(self.buckets) - 1
        for b in range(self._next_launch, last + 1):
            bucket = self.buckets[b]
            self.stage(bucket)
            self.launch(bucket, is_last=b == last)
        if self.hook is None:
            # Issued after every bucket: ranks may have launched different numbers of
            # buckets during backward, and collectives on one group must be issued in the
            # same order everywhere.
            self._used_map.start(flags, record)
        absent: list[tuple[BucketBuffers, int]] = []
        for bucket in self.buckets:
            self.finish(bucket)
            absent.extend((bucket, i) for i in self._write_back_present(bucket, flags))
        if self.hook is not None:
            # A hook may issue further collectives from its futures' callbacks (PowerSGD),
            # which gloo runs on its own thread: only once every future is done is the order
            # of collectives on the group the same on every rank.
            self._used_map.start(flags, record)
        self._used_map.check_agreement()
        global_used = self._used_map.counts().tolist() if absent else None
        for bucket, i in absent:
            self._write_back(bucket, i, global_used)
        self._end_sync(None)

    def _end_sync(self, unwaited_used_work: object = None) -> None:
        """All buckets are reduced and written back: reset (the argument is unused)."""
        self._reset_backward()

    def _reset_backward(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._fired = [False] * len(self._params)
        self._next_launch = 0

    def abandon(self) -> None:
        """Forget a backward that raised before it finished; observe the ready order anew."""
        for slot, fired in enumerate(self._fired):
            if fired:  # a real gradient arrived (perhaps into a bound view)
                self._preset[slot] = False
        self._reset_backward()
        if self._ready_order is not None:
            self._ready_order = []

    # ---- layout changes ---------------------------------------------------------------

    def rebuild(self) -> None:
        """Adopt rank 0's observed gradient-ready order as the layout (DDP's rebuild);
        only the first call after construction does anything."""
        if self._ready_order is None:
            return
        order, self._ready_order = self._ready_order, None
        slots = self._used_map.broadcast_order(order, len(self._params), self._group_src)
        names = [self._names[i] for i in slots]
        plan = gradsync_core.rebuild_buckets(self.plan, self._specs, names)
        if [b.slots for b in plan.buckets] == [b.slots for b in self.plan.buckets]:
            self.plan, self.layout = plan, layout_fingerprint(plan)
            return
        self._install(plan)
        if self.gradient_as_bucket_view:
            for bucket in self.buckets:
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view

    def bind_views(self) -> None:
        """gradient_as_bucket_view: let autograd accumulate straight into the buckets.

        Every parameter without a gradient gets its zeroed bucket view, one zeroing per
        bucket (the whole buffer when no parameter of it has a gradient, the usual case after
        ``zero_grad(set_to_none=True)``).
        """
        for bucket in self.buckets:
            unbound = [i for i, p in enumerate(bucket.params) if p.grad is None]
            if not unbound:
                continue
            if len(unbound) == len(bucket.params):
                bucket.buffer.zero_()
            else:
                torch._foreach_zero_([bucket.views[i] for i in unbound])
            for i in unbound:
                bucket.params[i].grad = bucket.views[i]
                self._preset[bucket.slot_ids[i]] = True
