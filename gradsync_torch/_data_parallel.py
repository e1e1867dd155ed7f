"""``DataParallel``: gradsync's bucket plans executed on torch.distributed (docs/design.md §3, §7, §8).

Overlap mode follows the DDP paper (arXiv:2006.15704): each bucket's all-reduce starts as soon
as its last gradient is accumulated, buckets start in plan order, and backward returns only
after all of them finished. Legacy mode is fairseq's ``LegacyDistributedDataParallel``: nothing
happens during backward; ``sync_gradients()`` reduces through one reused flat buffer.
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
from gradsync_torch._comm_hooks import CommHook
from gradsync_torch._reducer import BucketBuffers, Reducer, build_buckets, make_plan
from gradsync_torch._specs import named_parameters, param_specs
from gradsync_torch._verify import (
    broadcast_tensors,
    check_arguments,
    check_grad,
    check_group,
    comm_device,
    resolve_shared,
    state_entries,
    verify_same_everywhere,
)
from gradsync_torch.data_parallel.grad_sharding import GradientSharder, pad_for_sharding
from gradsync_torch.model_parallel.groups import (
    ProcessGroups,
    check_reduction_plan,
    reduce_shared_gradients,
)


def _wait_cpu(work: Any, tensor: torch.Tensor) -> torch.Tensor:
    work.wait()
    return tensor.cpu()


def _grad_ready(owner: weakref.ref, slot: int, param: torch.Tensor) -> None:
    wrapper = owner()
    if wrapper is not None:
        wrapper._on_grad_ready(slot, param)


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
            only its shard, which ``ZeroRedundancyOptimizer(..., shard_gradients=True)``
            over these parameters steps (see ``gradsync_torch._zero_grads``).
        groups: model parallelism (docs/design.md §6): the ``ProcessGroups`` of the topology. The
            data-parallel group is then ``groups["dp"]`` (leave ``process_group`` unset),
            and after every synced mean the gradients of parameters replicated over a
            model-parallel axis (a norm under context parallelism, a bias after a
            sequence-parallel reduce-scatter) get their sum over that axis, bucketed. Which
            ones is derived from the model (``shared_param_specs``: the layers'
            ``gradsync_sharded_over``, the model's ``gradsync_data_axes``), never marked.
            Construct on every rank of the world (it checks the plan across groups).
        shared_plan: the ``ReductionPlan`` to use instead of the derived one
            (``plan_shared_reductions(shared_param_specs(model, data_axes=...), topo)``).

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
        )
        process_group, shared_plan = resolve_shared(
            module,
            process_group=process_group,
            groups=groups,
            shared_plan=shared_plan,
            shard_gradients=shard_gradients,
        )
        group = check_group(process_group)
        if shared_plan is not None:
            check_reduction_plan(shared_plan, groups)  # collective over the world, once
        self.process_groups, self.shared_plan = groups, shared_plan
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
        # Plain attribute, as in DDP: no_sync() flips it, loops may set it directly.
        self.require_backward_grad_sync = True

        named = named_parameters(module)
        self._specs = param_specs(named)
        self._trainable = [(name, p) for name, p in named if p.requires_grad]
        self._frozen = [p for _, p in named if not p.requires_grad]
        self._slot_of = {name: i for i, (name, _) in enumerate(self._trainable)}
        self._comm_device = comm_device([p for _, p in self._trainable], group)

        plan = make_plan(self._specs, overlap=overlap, bucket_cap_mb=bucket_cap_mb)
        if shard_gradients:
            plan = pad_for_sharding(plan, self.world_size)
        options = {"overlap": overlap, "reduce": reduce, "reduce_dtype": reduce_dtype}
        options["shard_gradients"] = shard_gradients
        verify_same_everywhere(plan, state_entries(module, options), group, self._comm_device)
        # Every rank starts from rank 0's weights and buffers (DDP's _sync_module_states).
        broadcast_tensors([p for _, p in named] + [b for _, b in module.named_buffers()], group)

        self.shard_gradients = shard_gradients
        self._reducer = (
            GradientSharder(group, reduce=reduce, reduce_dtype=reduce_dtype, data_parallel=self)
            if shard_gradients
            else Reducer(group, reduce=reduce, reduce_dtype=reduce_dtype)
        )
        self._plan = plan
        self._buckets: list[BucketBuffers] = []
        self._where: list[tuple[int, int]] = []  # slot -> (bucket index, index in bucket)
        self._install(plan)
        n = len(self._trainable)
        self._fired = [False] * n  # gradient arrived in this synced backward
        self._preset = [False] * n  # grad is a zeroed bucket view we bound, not a gradient
        self._next_launch = 0
        self._callback_queued = False
        self._sync_backward = True  # decided by the latest grad-enabled forward (as DDP)
        self._sync_buffers_next = True
        self._dirty = False  # gradients accumulated under no_sync and not reduced yet
        self._syncs = 0
        self._used_work: Any = None  # an unwaited used-map all-reduce (see _sync_after_backward)
        self._params_broadcast_at = 0
        # Sharded gradients: the layout is the optimizer's ownership, so it stays fixed.
        self._ready_order: list[int] | None = [] if overlap and not shard_gradients else None
        self._hook_handles: list[Any] = []
        if overlap:
            # The hooks hold the wrapper weakly: once a user drops it (say, to wrap the module
            # again after unfreezing a layer), its hooks go quiet instead of syncing twice.
            me = weakref.ref(self)
            for slot, (_, p) in enumerate(self._trainable):
                hook = functools.partial(_grad_ready, me, slot)
                self._hook_handles.append(p.register_post_accumulate_grad_hook(hook))

    # ---- public API -------------------------------------------------------------------

    @property
    def gradient_sharder(self) -> GradientSharder | None:
        """The ZeRO-2 ``GradientSharder`` (``shard_gradients=True``), else ``None``."""
        return self._reducer if isinstance(self._reducer, GradientSharder) else None

    @property
    def bucket_plan(self) -> gradsync_core.BucketPlan:
        """The bucket layout in force (rebuilt once after the first synced backward)."""
        return self._plan

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
        self._reducer.hook = hook
        self._reducer.hook_state = state

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
        if torch.is_grad_enabled():
            self._check_frozen()
            self._sync_backward = self.require_backward_grad_sync
            if self._sync_backward and self.param_broadcast_period:
                due = self._syncs - self._params_broadcast_at >= self.param_broadcast_period
                if due:
                    broadcast_tensors(
                        [p for _, p in named_parameters(self.module)], self.process_group
                    )
                    self._params_broadcast_at = self._syncs
            if self.gradient_as_bucket_view:
                self._bind_views()
        if self.broadcast_buffers and self._sync_buffers_next and self.world_size > 1:
            buffers = [b for _, b in self.module.named_buffers()]
            if buffers:
                broadcast_tensors(buffers, self.process_group)
        self._sync_buffers_next = torch.is_grad_enabled() and self.require_backward_grad_sync
        return self.module(*args, **kwargs)

    # ---- construction helpers ---------------------------------------------------------

    def _install(self, plan: gradsync_core.BucketPlan) -> None:
        params = dict(self._trainable)
        self._buckets = build_buckets(
            plan, params, self._slot_of, reduce_dtype=self.reduce_dtype, shared=not self.overlap
        )
        self._where = [(0, 0)] * len(self._trainable)
        for b, bucket in enumerate(self._buckets):
            for i, slot in enumerate(bucket.slot_ids):
                self._where[slot] = (b, i)

    def _check_frozen(self) -> None:
        for p in self._frozen:
            if p.requires_grad:
                name = next(n for n, q in named_parameters(self.module) if q is p)
                raise RuntimeError(
                    f"parameter {name!r} was frozen when DataParallel was built and now "
                    "requires grad, so its gradient would never be synced; wrap the model "
                    "again after changing requires_grad"
                )

    # ---- during backward --------------------------------------------------------------

    def _on_grad_ready(self, slot: int, param: torch.Tensor) -> None:
        grad = param.grad
        if grad is None:
            return
        check_grad(self._trainable[slot][0], grad)
        self._preset[slot] = False
        if not self._sync_backward:
            self._dirty = True
            return
        if not self._callback_queued:
            # Runs when the whole backward is done, before backward() returns.
            torch.autograd.Variable._execution_engine.queue_callback(self._finish_backward)
            self._callback_queued = True
        if self._fired[slot]:
            raise RuntimeError(
                f"parameter {self._trainable[slot][0]!r} received its gradient twice in one "
                "backward (reentrant checkpointing?); use "
                "torch.utils.checkpoint(..., use_reentrant=False)"
            )
        self._fired[slot] = True
        if self._ready_order is not None:
            self._ready_order.append(slot)
        b, i = self._where[slot]
        bucket = self._buckets[b]
        view = bucket.views[i]
        if grad.data_ptr() != view.data_ptr():
            self._reducer.copy_in(view, grad)
            if self.gradient_as_bucket_view:
                param.grad = view
        else:
            self._reducer.scale_in_place(view)
        if self.shard_gradients:
            param.grad = None  # ZeRO-2: the bucket holds it until the reduce-scatter
        bucket.pending -= 1
        if bucket.pending == 0:
            last = len(self._buckets) - 1
            while self._next_launch <= last and self._buckets[self._next_launch].pending == 0:
                self._reducer.launch(
                    self._buckets[self._next_launch], is_last=self._next_launch == last
                )
                self._next_launch += 1

    def _finish_backward(self) -> None:
        try:
            self._sync_after_backward(from_backward=True)
        except BaseException:
            self._abandon_backward()
            raise
        finally:
            self._callback_queued = False

    # ---- the sync ---------------------------------------------------------------------

    def _fill(self, slot: int, param: nn.Parameter, view: torch.Tensor) -> None:
        """Put a slot's gradient into its bucket: the accumulated one, or zeros if none."""
        grad = param.grad
        if grad is None:
            view.zero_()
        elif grad.data_ptr() != view.data_ptr():
            check_grad(self._trainable[slot][0], grad)
            self._reducer.copy_in(view, grad)
        else:
            self._reducer.scale_in_place(view)

    def _has_grad(self, slot: int, param: nn.Parameter) -> bool:
        return self._fired[slot] or (param.grad is not None and not self._preset[slot])

    def _write_back(self, bucket: BucketBuffers, i: int, global_used: torch.Tensor | None) -> None:
        slot, param, view = bucket.slot_ids[i], bucket.params[i], bucket.views[i]
        if self.shard_gradients:  # ZeRO-2: this rank's shard is in the reducer, not .grad
            used = self._has_grad(slot, param)
            used = used or (global_used is not None and bool(global_used[slot] > 0))
            self._reducer.record_used(param, used)
            param.grad = None
            self._preset[slot] = False
            return
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

    def _sync_after_backward(self, *, from_backward: bool) -> None:
        if self._used_work is not None:
            self._used_work.wait()  # last sync's used-map, which this rank did not need then
            self._used_work = None
        flags = [self._has_grad(s, p) for s, (_, p) in enumerate(self._trainable)]
        has = torch.tensor(flags, dtype=torch.int32).to(self._comm_device)
        last = len(self._buckets) - 1
        # The used-map says which parameters got a gradient on any rank. A rank that had
        # every gradient never needs it, so it waits only at its next sync.
        if not self.overlap:
            # Legacy: the buckets share one buffer, so each is reduced and written back
            # before the next.
            used_work = dist.all_reduce(has, group=self.process_group, async_op=True)
            global_used = None if all(flags) else _wait_cpu(used_work, has)
            for bucket in self._buckets:
                for i, slot in enumerate(bucket.slot_ids):
                    self._fill(slot, bucket.params[i], bucket.views[i])
                self._reducer.launch(bucket, is_last=bucket.spec.index == last)
                self._reducer.finish(bucket)
                for i in range(len(bucket.params)):
                    self._write_back(bucket, i, global_used)
        else:
            for b in range(self._next_launch, last + 1):
                bucket = self._buckets[b]
                for i, slot in enumerate(bucket.slot_ids):
                    if not self._fired[slot]:
                        self._fill(slot, bucket.params[i], bucket.views[i])
                self._reducer.launch(bucket, is_last=b == last)
            # Issued after every bucket: ranks may have launched different numbers of
            # buckets during backward, and collectives must be issued in the same order.
            used_work = dist.all_reduce(has, group=self.process_group, async_op=True)
            unused: list[tuple[BucketBuffers, int]] = []
            for bucket in self._buckets:
                self._reducer.finish(bucket)
                for i, slot in enumerate(bucket.slot_ids):
                    if flags[slot]:
                        self._write_back(bucket, i, None)
                    else:
                        unused.append((bucket, i))
            global_used = _wait_cpu(used_work, has) if unused else None
            for bucket, i in unused:
                self._write_back(bucket, i, global_used)
        if global_used is None:
            self._used_work = used_work
        if self.shared_plan is not None:
            # The model-parallel sums (docs/design.md §6) commute with the dp mean and with
            # accumulation, so one pass after the mean covers every no_sync step too.
            reduce_shared_gradients(self.module, self.process_groups, self.shared_plan)
        self._next_launch = 0
        for bucket in self._buckets:
            bucket.reset()
        self._fired = [False] * len(self._trainable)
        self._dirty = False
        self._syncs += 1
        if from_backward and self._ready_order is not None:
            self._rebuild()

    def _rebuild(self) -> None:
        """Adopt rank 0's observed gradient-ready order as the layout (DDP's rebuild)."""
        order, self._ready_order = self._ready_order or [], None
        n = len(self._trainable)
        ranks_order = torch.full((n,), -1, dtype=torch.int64)
        if order:
            ranks_order[: len(order)] = torch.tensor(order, dtype=torch.int64)
        ranks_order = ranks_order.to(self._comm_device)
        dist.broadcast(
            ranks_order, src=dist.get_global_rank(self.process_group, 0), group=self.process_group
        )
        names = [self._trainable[i][0] for i in ranks_order.tolist() if i >= 0]
        plan = gradsync_core.rebuild_buckets(self._plan, self._specs, names)
        old = self._plan
        self._plan = plan
        if [b.slots for b in plan.buckets] == [b.slots for b in old.buckets]:
            return
        self._install(plan)
        if self.gradient_as_bucket_view:
            for bucket in self._buckets:
                for param, view in zip(bucket.params, bucket.views, strict=True):
                    if param.grad is not None:
                        view.copy_(param.grad)
                        param.grad = view

    def _bind_views(self) -> None:
        """gradient_as_bucket_view: let autograd accumulate straight into the buckets."""
        for slot, (_, p) in enumerate(self._trainable):
            if p.grad is None:
                b, i = self._where[slot]
                view = self._buckets[b].views[i]
                view.zero_()
                p.grad = view
                self._preset[slot] = True

    def _abandon_backward(self) -> None:
        for bucket in self._buckets:
            bucket.reset()
        self._fired = [False] * len(self._trainable)
        self._next_launch = 0
        self._callback_queued = False
        if self._ready_order is not None:
            self._ready_order = []
