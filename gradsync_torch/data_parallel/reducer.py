"""The ``Reducer``: owns every piece of bucket state and every gradient collective of a step.

``DataParallel`` decides *when* (a gradient became ready, the backward finished, the user
called ``sync_gradients()``); the Reducer decides *what* and *how*, the way DDP's Python wrapper
drives its C++ ``Reducer``. The wrapper talks to it through a few verbs:

- ``mark_ready(slot, param, grad)``: a gradient arrived during a synced backward; copy it
  into its bucket and start every bucket whose gradients are all in, in plan order (the DDP
  paper, arXiv:2006.15704: launch order must be the same on every rank).
- ``mark_accumulated(slot)``: a gradient arrived under ``no_sync()``; nothing to reduce yet.
- ``sync_overlap()`` / ``sync_legacy()``: after backward, reduce what is left, write the
  averages back into ``param.grad`` and reset for the next step (docs/design.md §7).
- ``rebuild()``: once, adopt rank 0's observed gradient-ready order as the layout.
- ``bind_views()``, ``abandon()``, ``set_comm_hook()``.

Besides the bucket collectives the Reducer issues the used-map all-reduce (which parameters
got a gradient on any rank) and the rebuild broadcast. ``GradientSharder``
(``grad_sharding.py``) subclasses it for ZeRO-2 and swaps the collective and the write-back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._agreement import check_grad
from gradsync_torch._collectives import global_rank
from gradsync_torch.data_parallel.buckets import BucketBuffers, build_buckets, slot_places
from gradsync_torch.data_parallel.comm_hooks import CommHook, GradBucket


def _wait_cpu(work: Any, tensor: torch.Tensor) -> torch.Tensor:
    work.wait()
    return tensor.cpu()


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
        comm_device: where the used-map and the rebuild broadcast run.
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
        comm_device: torch.device,
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
        self._comm_device = comm_device
        n = len(self._params)
        self._fired = [False] * n  # gradient arrived in this synced backward
        self._preset = [False] * n  # grad is a zeroed bucket view we bound, not a gradient
        self._next_launch = 0  # the first bucket not launched yet in this backward
        self._used_work: Any = None  # an unwaited used-map all-reduce (see sync_overlap)
        self._ready_order: list[int] | None = [] if record_ready_order else None
        self._install(plan)

    def _install(self, plan: gradsync_core.BucketPlan) -> None:
        self.plan = plan
        slot_of = {name: i for i, name in enumerate(self._names)}
        self.buckets = build_buckets(
            plan,
            dict(zip(self._names, self._params, strict=True)),
            slot_of,
            reduce_dtype=self.reduce_dtype,
            shared=not self.overlap,
        )
        self._where = slot_places(self.buckets, len(self._params))

    # ---- how one bucket is reduced ----------------------------------------------------

    def set_comm_hook(self, hook: CommHook, state: Any) -> None:
        """Reduce each bucket with ``hook(state, bucket)`` from now on (DDP's contract)."""
        self.hook, self.hook_state = hook, state

    @property
    def divides_on_copy(self) -> bool:
        # Without a hook or a wire dtype the mean's division rides on the copy into the
        # bucket (DDP does the same), saving one pass over every gradient.
        return self.mean and self.hook is None and self.reduce_dtype is None

    def copy_in(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        """Put one gradient into its bucket slot (divided already, where that is due)."""
        if self.divides_on_copy:
            torch.div(grad, self.world_size, out=view)
        else:
            view.copy_(grad)

    def scale_in_place(self, view: torch.Tensor) -> None:
        """The same for a gradient that already lives in its slot (gradient_as_bucket_view)."""
        if self.divides_on_copy:
            view.div_(self.world_size)

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

    # ---- during backward (the hot path: per parameter) --------------------------------

    def mark_accumulated(self, slot: int) -> None:
        """A gradient accumulated under ``no_sync()``: it is a real gradient from now on."""
        self._preset[slot] = False

    def mark_ready(self, slot: int, param: torch.Tensor, grad: torch.Tensor) -> None:
        """``param``'s gradient ``grad`` is complete for this synced backward.

        Raises:
            RuntimeError: if the same parameter reports twice in one backward.
        """
        self._preset[slot] = False
        if self._fired[slot]:
            raise RuntimeError(
                f"parameter {self._names[slot]!r} received its gradient twice in one "
                "backward (reentrant checkpointing?); use "
                "torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self._fired[slot] = True
        if self._ready_order is not None:
            self._ready_order.append(slot)
        place = self._where[slot]
        bucket = self.buckets[place.bucket]
        view = bucket.views[place.index]
        if grad.data_ptr() != view.data_ptr():
            self.copy_in(view, grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        else:
            self.scale_in_place(view)
        if not self.keeps_param_grads:
            param.grad = None  # ZeRO-2: the bucket holds it until the reduce-scatter
        bucket.pending -= 1
        if bucket.pending == 0:
            last = len(self.buckets) - 1
            while self._next_launch <= last and self.buckets[self._next_launch].pending == 0:
                self.launch(self.buckets[self._next_launch], is_last=self._next_launch == last)
                self._next_launch += 1

    # ---- after backward ---------------------------------------------------------------

    def _fill(self, slot: int, param: torch.Tensor, view: torch.Tensor) -> None:
        """Put a slot's gradient into its bucket: the accumulated one, or zeros if none."""
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            check_grad(self._names[slot], grad)  # legacy mode and no_sync have no hook check
            self.copy_in(view, grad)
        else:
            self.scale_in_place(view)

    def _has_grad(self, slot: int, param: torch.Tensor) -> bool:
        return self._fired[slot] or (param.grad is not None and not self._preset[slot])

    def _write_back(self, bucket: BucketBuffers, i: int, global_used: torch.Tensor | None) -> None:
        """Leave the reduced value of ``bucket``'s ``i``-th parameter in its ``.grad``."""
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

    def _used_flags(self) -> tuple[list[bool], torch.Tensor]:
        """Which slots have a gradient here, as a list and as the used-map to all-reduce.

        A rank that had every gradient never needs the reduced map, so it waits for it only
        at its next sync (``_used_work``).
        """
        if self._used_work is not None:
            self._used_work.wait()
            self._used_work = None
        flags = [self._has_grad(s, p) for s, p in enumerate(self._params)]
        return flags, torch.tensor(flags, dtype=torch.int32).to(self._comm_device)

    def sync_legacy(self) -> None:
        """Legacy mode: the buckets share one buffer, so each is filled, reduced and written
        back before the next (fairseq's ``LegacyDistributedDataParallel``)."""
        flags, used = self._used_flags()
        used_work = dist.all_reduce(used, group=self.group, async_op=True)
        global_used = None if all(flags) else _wait_cpu(used_work, used)
        last = len(self.buckets) - 1
        for bucket in self.buckets:
            for i, slot in enumerate(bucket.slot_ids):
                self._fill(slot, bucket.params[i], bucket.views[i])
            self.launch(bucket, is_last=bucket.spec.index == last)
            self.finish(bucket)
            for i in range(len(bucket.params)):
                self._write_back(bucket, i, global_used)
        self._end_sync(used_work if global_used is None else None)

    def sync_overlap(self) -> None:
        """Overlap mode: launch the buckets backward left behind (gradients that never
        arrived count as zeros), wait for every bucket and write the averages back."""
        flags, used = self._used_flags()
        last = len(self.buckets) - 1
        for b in range(self._next_launch, last + 1):
            bucket = self.buckets[b]
            for i, slot in enumerate(bucket.slot_ids):
                if not self._fired[slot]:
                    self._fill(slot, bucket.params[i], bucket.views[i])
            self.launch(bucket, is_last=b == last)
        # Issued after every bucket: ranks may have launched different numbers of buckets
        # during backward, and collectives must be issued in the same order.
        used_work = dist.all_reduce(used, group=self.group, async_op=True)
        unused: list[tuple[BucketBuffers, int]] = []
        for bucket in self.buckets:
            self.finish(bucket)
            for i, slot in enumerate(bucket.slot_ids):
                if flags[slot]:
                    self._write_back(bucket, i, None)
                else:
                    unused.append((bucket, i))
        global_used = _wait_cpu(used_work, used) if unused else None
        for bucket, i in unused:
            self._write_back(bucket, i, global_used)
        self._end_sync(used_work if global_used is None else None)

    def _end_sync(self, unwaited_used_work: Any) -> None:
        """Every bucket is reduced and written back: reset for the next backward."""
        self._used_work = unwaited_used_work
        self._reset_backward()

    def _reset_backward(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._fired = [False] * len(self._params)
        self._next_launch = 0

    def abandon(self) -> None:
        """Forget a backward that raised before it finished; observe the ready order anew."""
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
        ranks_order = torch.full((len(self._params),), -1, dtype=torch.int64)
        if order:
            ranks_order[: len(order)] = torch.tensor(order, dtype=torch.int64)
        ranks_order = ranks_order.to(self._comm_device)
        dist.broadcast(ranks_order, src=global_rank(self.group, 0), group=self.group)
        names = [self._names[i] for i in ranks_order.tolist() if i >= 0]
        plan = gradsync_core.rebuild_buckets(self.plan, self._specs, names)
        if [b.slots for b in plan.buckets] == [b.slots for b in self.plan.buckets]:
            self.plan = plan
            return
        self._install(plan)
        if self.gradient_as_bucket_view:
            for bucket in self.buckets:
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view

    def bind_views(self) -> None:
        """gradient_as_bucket_view: let autograd accumulate straight into the buckets."""
        for slot, p in enumerate(self._params):
            if p.grad is None:
                place = self._where[slot]
                view = self.buckets[place.bucket].views[place.index]
                view.zero_()
                p.grad = view
                self._preset[slot] = True
