"""``DataParallel``: bucket plans executed on torch.distributed (docs/design.md §3, §7, §8).

Overlap mode follows the DDP paper (arXiv:2006.15704): each bucket's all-reduce starts as soon
as its last gradient is accumulated, buckets start in plan order, and backward returns only
after all of them finished. Legacy mode is fairseq's ``LegacyDistributedDataParallel``: nothing
happens during backward; ``sync_gradients()`` reduces through one reused flat buffer.

The wrapper decides *when*: which forward is a synced one (``no_sync``), when a gradient is
handed over, when the backward is over. Its ``Reducer`` (``reducer.py``) owns the buckets and
decides *what* and *how*; ``setup.py`` holds the construction steps.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._agreement import check_arguments, check_group, comm_device
from gradsync_torch._collectives import broadcast_tensors
from gradsync_torch._specs import named_parameters
from gradsync_torch.data_parallel.backward_sink import attach_if_detached
from gradsync_torch.data_parallel.comm_hooks import CommHook
from gradsync_torch.data_parallel.grad_sharding import GradientSharder
from gradsync_torch.data_parallel.reducer import Reducer
from gradsync_torch.data_parallel.setup import (
    Layout,
    check_still_frozen,
    plan_layout,
    resolve_groups,
    verify_and_broadcast,
)
from gradsync_torch.data_parallel.sync_agreement import SyncHistory
from gradsync_torch.data_parallel.used_map import bookkeeping_group
from gradsync_torch.model_parallel.groups import (
    ProcessGroups,
    check_reduction_plan,
    reduce_shared_gradients,
)


def _grad_ready(owner: weakref.ref, slot: int, param: torch.Tensor) -> None:
    """A parameter's gradient is accumulated (``register_post_accumulate_grad_hook``).

    The one Python frame per gradient: the wrapper decides whether this backward syncs, the
    Reducer counts, and all real work (checks, copies, divisions, collectives) happens per
    bucket (docs/torch-data-parallel.md, "The hot path").
    """
    wrapper = owner()
    if wrapper is None or param.grad is None:
        return
    if not wrapper._sync_backward:
        wrapper._reducer.mark_accumulated(slot)
        wrapper._dirty = True
        if not wrapper._local_callback_queued:
            wrapper._backward_reached()
        return
    if not wrapper._callback_queued:
        wrapper._backward_reached()
    wrapper._reducer.mark_ready(slot)


def _notify_backward(owner: weakref.ref) -> None:
    """A backward ran through a ``BackwardSink`` (a forward that used no trainable parameter)."""
    wrapper = owner()
    if wrapper is not None:
        wrapper._backward_reached()


class DataParallel(nn.Module):
    """Data-parallel wrapper: ``forward`` passes through, gradients are averaged across ranks.

    Args:
        module: the model; every rank must build the same one (checked at construction).
        process_group: the data-parallel group (default: the world).
        bucket_cap_mb: bucket size limit in MiB. ``None`` (the default) is DDP's default:
            25 MiB buckets with a 1 MiB first bucket (the earliest layers, reduced last, so
            the tail after backward stays short). A number applies to every bucket, as in
            DDP. In legacy mode it sizes the reused buffer (default 2**28 elements).
        overlap: ``True``: reduce during backward. ``False``: legacy explicit mode, call
            ``sync_gradients()`` after backward.
        reduce: ``"mean"`` divides by the group size before the sum; ``"sum"`` does not.
        reduce_dtype: dtype on the wire (e.g. ``torch.bfloat16``); the result is cast back
            into the gradient dtype. ``None``: the gradients' own dtype.
        gradient_as_bucket_view: make ``param.grad`` views into the bucket buffers (saves the
            two copies and one gradient's worth of memory; overlap mode only).
        broadcast_buffers: broadcast buffers (BatchNorm statistics) from rank 0 before a
            forward that follows a synced training forward, as DDP does.
        param_broadcast_period: re-broadcast parameters from rank 0 every this many syncs
            (MegEngine's ``bcast_period``); 0 never does.
        shard_gradients: ZeRO-2: reduce-scatter each bucket (padded to a multiple of the
            group size) instead of all-reducing it and drop ``param.grad``; each rank keeps
            only its shard, which a ZeRO optimizer given this wrapper steps:
            ``ZeroRedundancyOptimizer(model.parameters(), ..., shard_gradients=True,
            data_parallel=model)``; a sync with no such optimizer raises.
        groups: model parallelism (docs/design.md §6): the topology's ``ProcessGroups``. The
            data-parallel group is then ``groups["dp"]``, and after every synced mean the
            gradients of parameters replicated over a model-parallel axis (a norm under
            context parallelism) get their sum over that axis, derived from the model
            (``shared_param_specs``). Construct on every rank of the world.
        shared_plan: the ``ReductionPlan`` to use instead of the derived one
            (``plan_shared_reductions(shared_param_specs(model, data_axes=...), topo)``).

    Every rank must reach each sync the same way (forwards, backwards, ``no_sync``, clearing
    gradients), checked at every sync at no extra collective; a rank whose forward used no
    trainable parameter still runs its backward and takes part with zeros.

    Raises:
        RuntimeError: if torch.distributed is not initialized.
        ValueError: on bad arguments, a group this rank is not in, or ranks whose models or
            arguments differ (naming the ranks and the first differing parameter).

    Example:
        >>> model = DataParallel(nn.Linear(4, 2))  # doctest: +SKIP
        >>> model(torch.randn(8, 4)).sum().backward()  # grads are averaged when this returns
        >>> with model.no_sync():  # accumulate locally; the next backward outside syncs
        ...     model(torch.randn(8, 4)).sum().backward()
        >>> groups = ProcessGroups(Topology.create(4, tp=2, cp=2))  # doctest: +SKIP
        >>> tp_cp_model = DataParallel(ParallelMLPTransformer(8, 32, 2, groups), groups=groups)
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        overlap: bool = True,
        reduce: str = "mean",
        reduce_dtype: torch.dtype | None = None,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        param_broadcast_period: int = 0,
        shard_gradients: bool = False,
        groups: ProcessGroups | None = None,
        shared_plan: gradsync_core.ReductionPlan | None = None,
    ) -> None:
        super().__init__()
        check_arguments(
            module,
            reduce=reduce,
            reduce_dtype=reduce_dtype,
            bucket_cap_mb=bucket_cap_mb,
            overlap=overlap,
            gradient_as_bucket_view=gradient_as_bucket_view,
            param_broadcast_period=param_broadcast_period,
            shard_gradients=shard_gradients,
        )
        choice = resolve_groups(
            module,
            process_group=process_group,
            groups=groups,
            shared_plan=shared_plan,
            shard_gradients=shard_gradients,
        )
        group = check_group(choice.process_group)
        if choice.shared_plan is not None:
            check_reduction_plan(choice.shared_plan, groups)  # collective over the world, once
        self.process_groups, self.shared_plan = groups, choice.shared_plan
        self.module = module
        self.process_group = group
        self.world_size = group.size()
        self.group_rank = dist.get_rank(group)
        self.overlap = overlap
        self.reduce = reduce
        self.reduce_dtype = reduce_dtype
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.broadcast_buffers = broadcast_buffers
        self.param_broadcast_period = param_broadcast_period
        self.shard_gradients = shard_gradients
        # Plain attribute, as in DDP: no_sync() flips it, loops may set it directly.
        self.require_backward_grad_sync = True

        layout = plan_layout(
            module,
            overlap=overlap,
            bucket_cap_mb=bucket_cap_mb,
            shard_gradients=shard_gradients,
            world_size=self.world_size,
        )
        self._names = [name for name, _ in layout.trainable]
        self._frozen = layout.frozen
        device = comm_device([p for _, p in layout.trainable], group)
        # Every option that changes the sequence of collectives or their arithmetic must agree
        # across ranks, or the ranks pair different collectives and hang (a buffer broadcast
        # meeting a bucket all-reduce); tests/faults walks the signature to keep this complete.
        options = {
            "bucket_cap_mb": bucket_cap_mb,
            "overlap": overlap,
            "reduce": reduce,
            "reduce_dtype": reduce_dtype,
            "gradient_as_bucket_view": gradient_as_bucket_view,
            "broadcast_buffers": broadcast_buffers,
            "param_broadcast_period": param_broadcast_period,
            "shard_gradients": shard_gradients,
        }
        verify_and_broadcast(module, layout.plan, options, group, device)
        self._reducer = self._make_reducer(layout, bookkeeping_group(group))

        self._callback_queued = False  # a backward's end-of-sync callback is pending
        self._local_callback_queued = False  # a no_sync backward's end callback is pending
        self._history = SyncHistory(layout.trainable[0][1] if layout.trainable else None)
        self._sink_anchor = torch.zeros((), requires_grad=True)  # see backward_sink.py
        self._sync_backward = True  # decided by the latest grad-enabled forward (as DDP)
        self._sync_buffers_next = True
        self._dirty = False  # gradients accumulated under no_sync and not reduced yet
        self._syncs = 0
        self._params_broadcast_at = 0
        # The hooks hold the wrapper weakly: once a user drops it (say, to wrap the module
        # again after unfreezing a layer), its hooks go quiet instead of syncing twice.
        me = weakref.ref(self)
        self._notify_backward = functools.partial(_notify_backward, me)
        for slot, (_, p) in enumerate(layout.trainable if overlap else ()):
            p.register_post_accumulate_grad_hook(functools.partial(_grad_ready, me, slot))

    def _make_reducer(self, layout: Layout, bookkeeping: dist.ProcessGroup) -> Reducer:
        if self.shard_gradients:
            return GradientSharder(
                self.process_group,
                layout.trainable,
                layout.specs,
                layout.plan,
                bookkeeping_group=bookkeeping,
                reduce=self.reduce,
                overlap=self.overlap,
                module_params=dict(named_parameters(self.module)),
            )
        return Reducer(
            self.process_group,
            layout.trainable,
            layout.specs,
            layout.plan,
            bookkeeping_group=bookkeeping,
            reduce=self.reduce,
            reduce_dtype=self.reduce_dtype,
            overlap=self.overlap,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            # Sharded gradients: the layout is the optimizer's ownership, so it stays fixed.
            record_ready_order=self.overlap,
        )

    # ---- public API -------------------------------------------------------------------

    @property
    def bucket_plan(self) -> gradsync_core.BucketPlan:
        """The bucket layout in force (rebuilt once after the first synced backward)."""
        return self._reducer.plan

    @property
    def gradient_sharder(self) -> GradientSharder | None:
        """The ZeRO-2 ``GradientSharder`` (``shard_gradients=True``), else ``None``; pass the
        wrapper to ``ZeroRedundancyOptimizer(..., data_parallel=model)``, which claims it."""
        return self._reducer if isinstance(self._reducer, GradientSharder) else None

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally; the first backward after the context syncs the sum.

        As in DDP, the forward decides: run forward and backward inside the context.
        """
        previous = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous

    def register_comm_hook(self, state: Any, hook: CommHook) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (DDP's contract).

        The hook owns the whole reduction, division included (see ``allreduce_hook``,
        ``bf16_compress_hook``, ``fp16_compress_hook``; torch's DDP hooks work too).
        Register it once, before the first backward.

        Raises:
            RuntimeError: if a hook is already registered or a sync already happened.
            ValueError: if ``reduce="sum"`` or ``reduce_dtype`` was set, which the hook
                would silently override.
        """
        if self._reducer.hook is not None:
            raise RuntimeError("register_comm_hook may be called only once")
        if self._syncs or self._callback_queued:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if self.reduce != "mean" or self.reduce_dtype is not None:
            raise ValueError(
                "a comm hook owns the reduction (division and wire dtype), so "
                f"reduce={self.reduce!r} / reduce_dtype={self.reduce_dtype} would be "
                "ignored; build DataParallel with the defaults and do it in the hook"
            )
        self._reducer.set_comm_hook(hook, state)

    def sync_gradients(self) -> None:
        """Reduce the gradients now (legacy mode: call it after every backward).

        Legacy mode: reduces every bucket through the reused buffer. Overlap mode: the
        backward already synced, so this only reduces gradients accumulated under
        ``no_sync()`` since the last sync (a no-op otherwise), so one loop fits both modes.
        Inside ``no_sync()`` it does nothing, as fairseq's ``all_reduce`` does.
        """
        if not self.require_backward_grad_sync:
            return
        if self._callback_queued:
            raise RuntimeError("sync_gradients() cannot run inside backward")
        if self.overlap and not self._dirty:
            return
        self._sync_after_backward(from_backward=False)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self._callback_queued:
            self._abandon_backward()  # the last backward raised before it finished
        self._local_callback_queued = False  # set here only if a no_sync backward raised
        training = torch.is_grad_enabled()
        if training:
            check_still_frozen(self._frozen, self.module)
            self._history.note_forward()
            self._sync_backward = self.require_backward_grad_sync
            if self._sync_backward and self.param_broadcast_period:
                self._maybe_broadcast_params()
            if self.gradient_as_bucket_view:
                self._reducer.bind_views()
        if self.broadcast_buffers and self._sync_buffers_next and self.world_size > 1:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                broadcast_tensors(buffers, self.process_group)
        self._sync_buffers_next = training and self.require_backward_grad_sync
        output = self.module(*args, **kwargs)
        if training and self.world_size > 1 and self._names:
            output = attach_if_detached(output, self._sink_anchor, self._notify_backward)
        return output

    # ---- before a forward -------------------------------------------------------------

    def _maybe_broadcast_params(self) -> None:
        """MegEngine's ``bcast_period``: rank 0's weights every ``param_broadcast_period``."""
        if self._syncs - self._params_broadcast_at >= self.param_broadcast_period:
            broadcast_tensors([p for _, p in named_parameters(self.module)], self.process_group)
            self._params_broadcast_at = self._syncs

    # ---- during and after backward ----------------------------------------------------

    def _backward_reached(self) -> None:
        """A backward reached the model: queue its end (runs before ``backward()`` returns)."""
        if not self.overlap:
            return  # legacy mode syncs in sync_gradients(); its backwards are not counted
        engine = torch.autograd.Variable._execution_engine
        if self._sync_backward:
            if not self._callback_queued:
                engine.queue_callback(self._finish_backward)
                self._callback_queued = True
        elif not self._local_callback_queued:
            engine.queue_callback(self._finish_local_backward)
            self._local_callback_queued = True

    def _finish_local_backward(self) -> None:
        self._history.local_backwards += 1
        self._local_callback_queued = False

    def _finish_backward(self) -> None:
        try:
            self._sync_after_backward(from_backward=True)
        except BaseException:
            self._abandon_backward()
            raise
        finally:
            self._callback_queued = False

    def _sync_after_backward(self, *, from_backward: bool) -> None:
        # Legacy mode has no gradient hooks, so its backwards are not counted (-1).
        backwards = self._history.local_backwards + from_backward if self.overlap else -1
        record = self._history.record(
            sync=self._syncs, layout=self._reducer.layout, backwards=backwards
        )
        if self.overlap:
            self._reducer.sync_overlap(record)
        else:
            self._reducer.sync_legacy(record)
        if self.shared_plan is not None:
            # The model-parallel sums (docs/design.md §6) commute with the dp mean and with
            # accumulation, so one pass after the mean covers every no_sync step too.
            reduce_shared_gradients(self.module, self.process_groups, self.shared_plan)
        self._dirty = False
        self._syncs += 1
        self._history.synced()
        if from_backward:
            self._reducer.rebuild()  # once: DDP's rebuild from the observed ready order

    def _abandon_backward(self) -> None:
        self._reducer.abandon()
        self._callback_queued = False
