"""The ``Reducer``: owns the buckets and the backward of every synced step (DDP's ``Reducer``).

As in DDP, the wrapper calls a few verbs and never sees a gradient: ``prepare_for_forward``
(is the coming backward a synced one), ``sync_gradients`` (legacy mode, or what ``no_sync``
left) and ``backward_reached`` (a backward with no trainable parameter in it), and hands it
the outputs of each training forward (``watch_outputs``). The Reducer hooks every trainable
parameter itself (through its ``BucketReadiness``), queues its own end-of-backward callback
(``finalize``) and there, after the last bucket, runs the runtime agreement check, writes
the results back and runs the shared-parameter sums (``SharedReducer``, docs/design.md §6).

Readiness is per bucket (``readiness.py``: the hooks, one Python frame per bucket); a flush
takes the arrivals since the last one (``take_arrivals``), gathers each complete bucket in
one batch (``gather_gradients``) and launches in plan order (arXiv:2006.15704: the same
order on every rank). How a bucket is reduced is the ``BucketCollective`` the Reducer is
given (``bucket_collectives.py``: all-reduce, a comm hook, or ZeRO-2's reduce-scatter).
Besides the buckets it issues the used-map all-reduce (carrying the runtime agreement check)
and the rebuild broadcast, on CPU tensors over gloo (``used_map.py``).

Where a per-bucket check belongs: ``_stage`` runs once per bucket right before its launch
(every gradient of the bucket is in its buffer), ``_end_sync`` once per sync after the last
write-back.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._collectives import global_rank
from gradsync_torch._grads import check_grad
from gradsync_torch.data_parallel.bucket_collectives import BucketCollective
from gradsync_torch.data_parallel.buckets import (
    PER_TENSOR_DIVISION_MIN_NUMEL,
    BucketBuffers,
    GradSlots,
    build_buckets,
)
from gradsync_torch.data_parallel.finite_check import FiniteCheck
from gradsync_torch.data_parallel.peer_failures import naming_peer_failures
from gradsync_torch.data_parallel.readiness import BucketReadiness
from gradsync_torch.data_parallel.sync_agreement import SyncHistory, layout_fingerprint
from gradsync_torch.data_parallel.used_map import UsedMap
from gradsync_torch.data_parallel.used_map import bookkeeping_group as make_bookkeeping_group

_UNNOTICED_BACKWARD = (
    "a synced backward accumulated gradients into the wrapped module's parameters without "
    "reaching the DataParallel's outputs or any bucket's last parameter, so they were not "
    "reduced; compute the loss from the output of a DataParallel forward"
)


class Reducer:
    """Bucket state, the backward of every step, and the collectives over the data-parallel
    group (all of them but the forward's broadcasts, which the wrapper issues).

    Args:
        group: the data-parallel process group.
        trainable: ``(name, parameter)`` of every trainable parameter; a parameter's
            position is its *slot*.
        specs: the specs of every parameter (frozen ones too), for rebuilding the plan.
        plan: the initial bucket layout.
        slots: the per-parameter flags, shared with ``collective``.
        collective: how a bucket is reduced (``AllReduce``, ``CommHook``, ``ReduceScatter``).
        bookkeeping_group: a gloo group over the same ranks, for the used-map and the
            rebuild broadcast on CPU tensors; ``None``: ``used_map.bookkeeping_group(group)``.
        reduce_dtype: the dtype on the wire (wire buffers are allocated for the buckets of
            another dtype), ``None`` for the gradients' own.
        overlap: reduce during backward, one buffer per bucket (``True``); or fairseq's
            legacy mode: one reused buffer, reduced by ``sync_gradients()`` after backward.
        gradient_as_bucket_view: leave ``param.grad`` as a view into its bucket.
        record_ready_order: observe the first synced backward's ready order for ``rebuild``.
        shared: the model-parallel sums to run after every sync, if any.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        trainable: Sequence[tuple[str, nn.Parameter]],
        specs: Sequence[gradsync_core.ParamSpec],
        plan: gradsync_core.BucketPlan,
        *,
        slots: GradSlots,
        collective: BucketCollective,
        bookkeeping_group: dist.ProcessGroup | None = None,
        reduce_dtype: torch.dtype | None = None,
        overlap: bool,
        gradient_as_bucket_view: bool = False,
        record_ready_order: bool,
        shared: Any = None,
    ) -> None:
        self.group = group
        self.reduce_dtype = reduce_dtype
        self.overlap = overlap
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.collective = collective
        self.shared = shared
        self.slots = slots
        self._names = [name for name, _ in trainable]
        self._params = [p for _, p in trainable]
        self._specs = list(specs)
        if bookkeeping_group is None:
            bookkeeping_group = make_bookkeeping_group(group)
        self._used_map = UsedMap(bookkeeping_group)
        self._group_src = global_rank(bookkeeping_group, 0)
        self._next_launch = 0  # the first bucket not launched yet in this backward
        self._ready_order: list[int] | None = [] if record_ready_order else None
        # Per-bucket readiness (docs/torch-data-parallel.md, "The hot path"). Its hooks hold
        # the Reducer weakly: once a user drops the wrapper (say, to wrap the module again
        # after unfreezing a layer), its hooks are removed instead of syncing twice.
        self.readiness = BucketReadiness(self._params, self)
        self._install(plan)
        # The backward's state machine (DDP's Reducer keeps the same flags).
        self._history = SyncHistory(self._params[0] if self._params else None)
        self.sync_count = 0  # completed syncs
        self._sync_backward = True  # decided by the latest grad-enabled forward (as DDP)
        self._callback_queued = False  # a synced backward's finalize is queued
        self._local_callback_queued = False  # a no_sync backward's end callback is queued
        self._dirty = False  # gradients accumulated under no_sync and not reduced yet
        # Under Join (join.py), set by the wrapper at every forward: how many ranks have not
        # joined (None: all of them), and the mean's divisor when it is not the group size
        # (DDP's divide_by_initial_world_size=False).
        self.active_ranks: int | None = None
        self.join_divisor: int | None = None
        self._joined = False  # the sync in progress is a joined rank's shadow
        self.finite_check: FiniteCheck | None = None  # check_finite=True (finite_check.py)

    def watch_outputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Learn that a backward reached the model from its outputs too (``tensors``: those
        that require grad), so a backward whose flush parameters are all unused still syncs."""
        if self.overlap:
            self.readiness.watch_outputs(tensors)

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
        self.collective.install(self.buckets)
        if self.overlap:
            self.readiness.install(self.buckets)

    # ---- the wrapper's verbs ----------------------------------------------------------

    @property
    def has_params(self) -> bool:
        return bool(self._params)

    @property
    def in_backward(self) -> bool:
        """A synced backward reached the model and has not finished."""
        return self._callback_queued

    def set_collective(self, collective: BucketCollective) -> None:
        """Reduce each bucket with ``collective`` from now on (a comm hook)."""
        self.collective = collective
        collective.install(self.buckets)

    def prepare_for_forward(self, *, training: bool, sync: bool) -> None:
        """A forward starts; ``sync``: its backward syncs (``require_backward_grad_sync``)."""
        if self._callback_queued:
            self.abandon()  # the last backward raised before it finished
        self.take_arrivals()  # a no_sync backward's, if its end callback was not queued
        self._local_callback_queued = False  # set here only if a no_sync backward raised
        if training:
            self._history.note_forward()
            self._sync_backward = sync
            if self.gradient_as_bucket_view:
                self.bind_views()

    def backward_reached(self) -> None:
        """A backward reached the model: queue its end (runs before ``backward()`` returns)."""
        if not self.overlap:
            return  # legacy mode syncs in sync_gradients(); its backwards are not counted
        engine = torch.autograd.Variable._execution_engine
        if self._sync_backward:
            if not self._callback_queued:
                engine.queue_callback(self._finalize)
                self._callback_queued = True
        elif not self._local_callback_queued:
            engine.queue_callback(self._finish_local_backward)
            self._local_callback_queued = True

    @property
    def notify_backward(self) -> Any:
        """``backward_reached`` holding the Reducer weakly, for a ``BackwardSink``."""
        return self.readiness.reached if self.overlap else (lambda: None)

    def sync_gradients(self) -> None:
        """Reduce now: legacy mode's sync, or what ``no_sync()`` accumulated (overlap mode).

        Raises:
            RuntimeError: inside a backward.
        """
        if self._callback_queued:
            raise RuntimeError("sync_gradients() cannot run inside backward")
        self.take_arrivals()
        if self.overlap and not self._dirty:
            return
        self._sync(from_backward=False)

    def buffer_tensors(self) -> list[torch.Tensor]:
        """Every gradient buffer held now (bucket and wire buffers, or ZeRO-2's pool and
        shards): what the gradient-memory benchmark counts."""
        held = getattr(self.collective, "buffer_tensors", None)
        if held is not None:
            return held()
        tensors = [b.buffer for b in self.buckets]
        return tensors + [b.wire for b in self.buckets if b.wire is not None]

    # ---- during backward (the hot path: per bucket) --------------------------------------

    def take_arrivals(self) -> None:
        """Account for every gradient that arrived since the last call: in a synced backward
        count it against its bucket, stage each bucket that is complete and launch in plan
        order; after a ``no_sync`` backward, note a real gradient to reduce later.

        Raises:
            RuntimeError: if the same parameter reports twice in one backward, or if a synced
                backward reached the parameters without this Reducer noticing it.
        """
        slots = self.readiness.take()
        if not slots:
            return
        if not self._sync_backward:
            preset = self.slots.preset
            for slot in slots:
                preset[slot] = False  # a real gradient from now on
            self._dirty = True
            return
        if not self._callback_queued:
            raise RuntimeError(_UNNOTICED_BACKWARD)
        if self._ready_order is not None:
            self._ready_order.extend(slots)
        fired, bucket_of = self.slots.fired, self._bucket_of
        for slot in slots:
            if fired[slot]:
                raise RuntimeError(
                    f"parameter {self._names[slot]!r} received its gradient twice in one "
                    "backward (reentrant checkpointing?); use "
                    "torch.utils.checkpoint(..., use_reentrant=False)"
                )
        # Staging may wait for an earlier bucket's collective (ZeRO-2's pooled buffer).
        with naming_peer_failures(f"gradient sync #{self.sync_count}"):
            for slot in slots:
                fired[slot] = True
                bucket = bucket_of[slot]
                bucket.pending -= 1
                if bucket.pending == 0:
                    self._stage(bucket)
                    self.readiness.completed(bucket.spec.index, slot)
            self._launch_complete()

    def _stage(self, bucket: BucketBuffers) -> None:
        """Put every gradient of ``bucket`` into its slot, divided where that is due; the
        gradients are checked here, once per bucket, so the per-gradient hook stays a counter.
        """
        collective = self.collective
        collective.prepare(bucket)
        per_tensor = self._per_tensor_division[bucket.spec.index]
        divisor = collective.divisor(bucket)
        if divisor is not None and self.join_divisor is not None:
            divisor = self.join_divisor
        copied = gather_gradients(bucket, self._names, divisor=divisor, per_tensor=per_tensor)
        collective.staged(bucket, copied)
        bucket.staged = True
        if self.finite_check is not None:
            self.finite_check.local(bucket)

    def _launch_complete(self) -> None:
        """Launch every staged bucket from the first unlaunched one on, in plan order."""
        buckets, last = self.buckets, len(self.buckets) - 1
        while self._next_launch <= last and buckets[self._next_launch].pending == 0:
            self.collective.launch(buckets[self._next_launch], is_last=self._next_launch == last)
            self._next_launch += 1

    # ---- after backward ---------------------------------------------------------------

    def _finish_local_backward(self) -> None:
        self.take_arrivals()
        self.readiness.forget()
        self._history.local_backwards += 1
        self._local_callback_queued = False

    def shadow_sync(self) -> None:
        """A rank that joined (ran out of batches under ``Join``) takes part in the sync the
        other ranks run: it contributes zeros to every bucket, as DDP's join hook does, and
        reads the average back into ``param.grad`` (a ZeRO optimizer joined with the wrapper
        then steps its shard with the same gradients as every other rank)."""
        for param in self._params:
            param.grad = None
        self.slots.fired = [False] * len(self._params)
        self.slots.preset = [False] * len(self._params)
        self._joined = True
        try:
            self._sync(from_backward=self.overlap)
        finally:
            self._joined = False

    def _finalize(self) -> None:
        """The end of a synced backward (queued on the autograd engine)."""
        try:
            self.take_arrivals()
            self._sync(from_backward=True)
            self.readiness.repick_flush()
        except BaseException:
            self.abandon()
            raise
        finally:
            self._callback_queued = False

    def _sync(self, *, from_backward: bool) -> None:
        # Legacy mode has no gradient hooks, so its backwards are not counted (-1).
        backwards = self._history.local_backwards + from_backward if self.overlap else -1
        record = None
        if not self._joined:
            record = self._history.record(
                sync=self.sync_count, layout=self.layout, backwards=backwards
            )
        what = f"gradient sync #{self.sync_count}"
        with naming_peer_failures(what):
            if self.overlap:
                self._sync_overlap(record)
            else:
                self._sync_legacy(record)
            if self.shared is not None:
                # The model-parallel sums (docs/design.md §6) commute with the dp mean and
                # with accumulation, so one pass after the mean covers every no_sync step too.
                self.shared.reduce()
        self._dirty = False
        self.sync_count += 1
        self._history.synced()
        if from_backward:
            with naming_peer_failures(what):
                self.rebuild()  # once: DDP's rebuild from the observed ready order
        if self.finite_check is not None:
            self.finite_check.verify(self.sync_count - 1)  # raises alike on every rank

    def _present_flags(self) -> list[bool]:
        """Per slot, whether this rank has a gradient to contribute in this sync."""
        fired = self.slots.fired
        if all(fired):
            return fired
        return [self.slots.has_grad(s, p) for s, p in enumerate(self._params)]

    def _start_used_map(self, flags: list[bool], record: Any) -> None:
        self._used_map.start(flags, record, joined=self._joined, active=self.active_ranks)

    def _sync_legacy(self, record: Any) -> None:
        """Legacy mode: the buckets share one buffer, so each is filled, reduced and written
        back before the next (fairseq's ``LegacyDistributedDataParallel``). ``record``: how
        this rank reached the sync, checked against every rank's (``sync_agreement.py``)."""
        flags = self._present_flags()
        self._start_used_map(flags, record)
        self._used_map.check_agreement()  # before any bucket: a mismatch moves no gradient
        global_used = None if all(flags) else self._used_map.counts().tolist()
        collective, last = self.collective, len(self.buckets) - 1
        for bucket in self.buckets:
            self._stage(bucket)
            collective.launch(bucket, is_last=bucket.spec.index == last)
            collective.finish(bucket)
            if self.finite_check is not None:
                self.finite_check.reduced(bucket)
            for i in collective.write_back(bucket, flags):
                collective.write_back_absent(bucket, i, global_used)
        self._end_sync()

    def _sync_overlap(self, record: Any) -> None:
        """Overlap mode: launch the buckets backward left behind (missing gradients count as
        zeros), wait for every bucket, check ``record`` (as in legacy mode), write back."""
        flags = self._present_flags()
        collective, last = self.collective, len(self.buckets) - 1
        for b in range(self._next_launch, last + 1):
            if not self.buckets[b].staged:  # staged already: complete, after an incomplete one
                self._stage(self.buckets[b])
            collective.launch(self.buckets[b], is_last=b == last)
        if not collective.chains_collectives:
            # Issued after every bucket: ranks may have launched different numbers of
            # buckets during backward, and collectives on one group must be issued in the
            # same order everywhere.
            self._start_used_map(flags, record)
        absent: list[tuple[BucketBuffers, int]] = []
        for bucket in self.buckets:
            collective.finish(bucket)
            if self.finite_check is not None:
                self.finite_check.reduced(bucket)
            absent.extend((bucket, i) for i in collective.write_back(bucket, flags))
        if collective.chains_collectives:
            # Only once every future is done is the order of collectives on the group the
            # same on every rank.
            self._start_used_map(flags, record)
        self._used_map.check_agreement()
        global_used = self._used_map.counts().tolist() if absent else None
        for bucket, i in absent:
            collective.write_back_absent(bucket, i, global_used)
        self._end_sync()

    def _end_sync(self) -> None:
        self._reset_backward()
        self.collective.end_sync()

    def _reset_backward(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self.slots.fired = [False] * len(self._params)
        self._next_launch = 0
        self.readiness.forget()
        self.collective.reset()

    def abandon(self) -> None:
        """Forget a backward that raised before it finished; observe the ready order anew."""
        for slot in self.readiness.abandon():  # a real gradient arrived (perhaps into a view)
            self.slots.preset[slot] = False
        self._reset_backward()
        if self.finite_check is not None:
            self.finite_check.reset()
        if self._ready_order is not None:
            self._ready_order = []
        self._callback_queued = False

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
                self.slots.preset[bucket.slot_ids[i]] = True


def gather_gradients(
    bucket: BucketBuffers, names: list[str], *, divisor: int | None, per_tensor: bool
) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """Put every ``param.grad`` of ``bucket`` into its view, divided by ``divisor`` if given.

    A parameter without a gradient contributes zeros; a gradient that is its bucket view
    already is only divided. ``per_tensor``: divide each gradient while copying it (one pass
    over memory); otherwise one ``torch._foreach_copy_`` and one division of the flat buffer,
    the same bits (elementwise; zeros and padding stay zero). The division is DDP's
    multiplication by ``1 / divisor`` in the gradient dtype (its Reducer's ``mul_out``): the
    same bits as DDP for any group size, where ``grad / 3`` and ``grad * (1/3)`` can differ.

    Args:
        bucket: the bucket to fill.
        names: parameter names by slot, for the error messages.
        divisor: the group size for a mean fused into the copy, else ``None``.
        per_tensor: see above (``PER_TENSOR_DIVISION_MIN_NUMEL``).

    Returns:
        ``(param, view)`` of every gradient that was copied (not already a view).

    Raises:
        RuntimeError: for a sparse gradient or one that requires grad (``check_grad``).
    """
    zeros: list[torch.Tensor] = []
    targets: list[torch.Tensor] = []
    sources: list[torch.Tensor] = []
    copied: list[tuple[nn.Parameter, torch.Tensor]] = []
    in_place: list[torch.Tensor] = []
    for param, view, slot in zip(bucket.params, bucket.views, bucket.slot_ids, strict=True):
        grad = param.grad
        if grad is None:
            zeros.append(view)
            continue
        if grad.layout != torch.strided or grad.requires_grad:
            check_grad(names[slot], grad)
        if grad.data_ptr() == view.data_ptr():
            in_place.append(view)
        else:
            targets.append(view)
            sources.append(grad)
            copied.append((param, view))
    if zeros:
        torch._foreach_zero_(zeros)
    if divisor is None:
        if targets:
            torch._foreach_copy_(targets, sources)
    elif per_tensor:
        scale = 1.0 / divisor
        for view, grad in zip(targets, sources, strict=True):
            torch.mul(grad, scale, out=view)  # DDP's fused copy: one pass
        if in_place:
            torch._foreach_mul_(in_place, scale)
    else:
        if targets:
            torch._foreach_copy_(targets, sources)
        bucket.buffer.mul_(1.0 / divisor)
    return copied
