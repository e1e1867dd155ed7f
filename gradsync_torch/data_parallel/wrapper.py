"""``DataParallel``: bucket plans executed on torch.distributed (docs/design.md §3, §7, §8).

Overlap mode follows the DDP paper (arXiv:2006.15704): each bucket's all-reduce starts as soon
as its last gradient is accumulated, buckets start in plan order, and backward returns only
after all of them finished. Legacy mode is fairseq's ``LegacyDistributedDataParallel``: nothing
happens during backward; ``sync_gradients()`` reduces through one reused flat buffer.

As in DDP, the wrapper keeps the forward (buffer and parameter broadcasts, the backward sink
of a forward that used no parameter) and the user's verbs (``no_sync``,
``register_comm_hook``, ``sync_gradients``); its ``Reducer`` (``reducer.py``) registers the
gradient hooks, owns the buckets and the backward, and is given the bucket collective
(``bucket_collectives.py``; ZeRO-2's ``ReduceScatter``). ``setup.py`` holds the construction
steps, ``options.py`` the options every rank must agree on.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.join import Join, Joinable

import gradsync_core
from gradsync_core.options import takes_options
from gradsync_torch._collectives import broadcast_tensors
from gradsync_torch.data_parallel.backward_sink import watch_backward
from gradsync_torch.data_parallel.bucket_collectives import AllReduce, BucketCollective, CommHook
from gradsync_torch.data_parallel.buckets import GradSlots
from gradsync_torch.data_parallel.comm_hooks import CommHook as HookFn
from gradsync_torch.data_parallel.finite_check import FiniteCheck
from gradsync_torch.data_parallel.grad_sharding import ReduceScatter
from gradsync_torch.data_parallel.join import DataParallelJoinHook, exchange_status
from gradsync_torch.data_parallel.options import (
    DataParallelOptions,
    check_group,
    check_module,
    comm_device,
)
from gradsync_torch.data_parallel.peer_failures import naming_peer_failures
from gradsync_torch.data_parallel.reducer import Reducer
from gradsync_torch.data_parallel.setup import (
    Layout,
    ModuleParams,
    broadcast_state,
    check_still_frozen,
    plan_layout,
    resolve_groups,
    state_entries,
    verify_same_everywhere,
)
from gradsync_torch.data_parallel.used_map import bookkeeping_group
from gradsync_torch.groups import ProcessGroups
from gradsync_torch.shared_reductions import SharedReducer, check_reduction_plan


class DataParallel(nn.Module, Joinable):
    """Data-parallel wrapper: ``forward`` passes through, gradients are averaged across ranks.

    The options every rank must agree on come as DDP's keywords (``bucket_cap_mb`` to
    ``check_finite`` below) or as one ``DataParallelOptions`` record (``options=``, the same
    names), not both.

    Args:
        module: the model; every rank must build the same one (checked at construction).
        process_group: the data-parallel group, a torch ``ProcessGroup`` (default: the
            world).
        groups: model parallelism (docs/design.md §6): the topology's ``ProcessGroups``. The
            data-parallel group (``process_group``) is then ``groups["dp"]``, and after every
            synced mean the gradients of parameters replicated over a model-parallel axis (a
            norm under context parallelism) get their sum over that axis, derived from the
            model (``shared_param_specs``). Construct on every rank of the world.
        shared_plan: the ``ReductionPlan`` to use instead of the derived one
            (``plan_shared_reductions(shared_param_specs(model, data_axes=...), topo)``).
        options: the options below as one ``DataParallelOptions`` (then give none of them).
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
        check_finite: after every sync, raise ``FloatingPointError`` on every rank if a
            gradient went NaN or infinite, naming the rank(s) it came from and the
            parameter(s); rides on the all-reduce (docs/torch-data-parallel.md, "Finding a
            NaN gradient"). Not with ``shard_gradients``.

    Every rank must reach each sync the same way (forwards, backwards, ``no_sync``, clearing
    gradients), checked at every sync at no extra collective; a rank whose forward used no
    trainable parameter still runs its backward and takes part with zeros.

    Raises:
        RuntimeError: if torch.distributed is not initialized.
        ValueError: on bad arguments, a group this rank is not in, or ranks whose models or
            arguments differ (naming the ranks and the first differing parameter).
        TypeError: ``options`` together with any of its fields.

    Example:
        >>> model = DataParallel(nn.Linear(4, 2))  # doctest: +SKIP
        >>> model(torch.randn(8, 4)).sum().backward()  # grads are averaged when this returns
        >>> with model.no_sync():  # accumulate locally; the next backward outside syncs
        ...     model(torch.randn(8, 4)).sum().backward()
        >>> groups = ProcessGroups(Topology.create(4, tp=2, cp=2))  # doctest: +SKIP
        >>> tp_cp_model = DataParallel(ParallelMLPTransformer(8, 32, 2, groups), groups=groups)
        >>> options = DataParallelOptions(bucket_cap_mb=50, check_finite=True)
        >>> model = DataParallel(nn.Linear(4, 2), options=options)  # the same, as a record
    """

    @takes_options(DataParallelOptions)
    def __init__(
        self,
        module: nn.Module,
        *,
        process_group: dist.ProcessGroup | None = None,
        groups: ProcessGroups | None = None,
        shared_plan: gradsync_core.ReductionPlan | None = None,
        options: DataParallelOptions | None = None,
        bucket_cap_mb: float | None = None,
        overlap: bool = True,
        reduce: str = "mean",
        reduce_dtype: torch.dtype | None = None,
        gradient_as_bucket_view: bool = False,
        broadcast_buffers: bool = True,
        param_broadcast_period: int = 0,
        shard_gradients: bool = False,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        Joinable.__init__(self)
        check_module(module)
        if options is None:
            options = DataParallelOptions(
                bucket_cap_mb=bucket_cap_mb,
                overlap=overlap,
                reduce=reduce,
                reduce_dtype=reduce_dtype,
                gradient_as_bucket_view=gradient_as_bucket_view,
                broadcast_buffers=broadcast_buffers,
                param_broadcast_period=param_broadcast_period,
                shard_gradients=shard_gradients,
                check_finite=check_finite,
            )
        elif not isinstance(options, DataParallelOptions):
            raise TypeError(f"options must be a DataParallelOptions, got {type(options).__name__}")
        self.options = options
        params = ModuleParams.of(module)  # the one walk over the module's parameters
        choice = resolve_groups(
            module,
            params,
            process_group=process_group,
            groups=groups,
            shared_plan=shared_plan,
            shard_gradients=options.shard_gradients,
        )
        group = check_group(choice.process_group)
        if choice.shared_plan is not None:
            assert groups is not None  # resolve_groups plans sums only with groups
            check_reduction_plan(choice.shared_plan, groups)  # collective over the world, once
        self.module = module
        self.process_group = group
        self.world_size = group.size()
        self.group_rank = dist.get_rank(group)
        self.shared_plan = choice.shared_plan
        # Plain attribute, as in DDP: no_sync() flips it, loops may set it directly.
        self.require_backward_grad_sync = True

        layout = plan_layout(params, self.options, self.world_size)
        device = comm_device([p for _, p in layout.trainable], group)
        self._device = device
        self._divide_by_initial_world_size = True  # set by join_hook(), as in DDP
        # The first collective of a construction: every rank must hold the same plan, model
        # and options, or the ranks pair different collectives and hang (docs/design.md §15).
        verify_same_everywhere(
            layout.plan, state_entries(params, module, self.options), group, device
        )
        broadcast_state(module, params, group, groups)
        shared = None
        if choice.shared_plan is not None:
            assert groups is not None  # resolve_groups plans sums only with groups
            shared = SharedReducer(choice.shared_plan, groups, dict(params.named))
        self._frozen = layout.frozen
        self._reducer = self._make_reducer(layout, params, shared)
        self._sink_anchor = torch.zeros((), requires_grad=True)  # see backward_sink.py
        self._sync_buffers_next = True
        self._params_broadcast_at = 0

    def _make_reducer(
        self, layout: Layout, params: ModuleParams, shared: SharedReducer | None
    ) -> Reducer:
        options, group = self.options, self.process_group
        slots = GradSlots(len(layout.trainable))
        mean = options.reduce == "mean"
        collective: BucketCollective
        if options.shard_gradients:
            collective = ReduceScatter(
                group, slots, mean=mean, overlap=options.overlap, module_params=dict(params.named)
            )
        else:
            collective = AllReduce(group, slots, mean=mean, views=options.gradient_as_bucket_view)
        reducer = Reducer(
            group,
            layout.trainable,
            layout.specs,
            layout.plan,
            slots=slots,
            collective=collective,
            bookkeeping_group=bookkeeping_group(group),
            reduce_dtype=options.reduce_dtype,
            overlap=options.overlap,
            gradient_as_bucket_view=options.gradient_as_bucket_view,
            # Sharded gradients: the layout is the optimizer's ownership, so it stays fixed.
            record_ready_order=options.overlap and not options.shard_gradients,
            shared=shared,
        )
        if options.check_finite:
            named = layout.trainable
            reducer.finite_check = FiniteCheck(group, [n for n, _ in named], [p for _, p in named])
        return reducer

    # ---- public API -------------------------------------------------------------------

    @property
    def reducer(self) -> Reducer:
        """The ``Reducer`` that owns the buckets and the backward (read-only, as DDP's
        ``ddp.reducer``): for inspection and benchmarks, not for driving it."""
        return self._reducer

    @property
    def bucket_plan(self) -> gradsync_core.BucketPlan:
        """The bucket layout in force (rebuilt once after the first synced backward)."""
        return self._reducer.plan

    @property
    def gradient_sharder(self) -> ReduceScatter | None:
        """ZeRO-2's ``ReduceScatter`` (``shard_gradients=True``), else ``None``; pass the
        wrapper to ``ZeroRedundancyOptimizer(..., data_parallel=model)``, which claims it."""
        collective = self._reducer.collective
        return collective if isinstance(collective, ReduceScatter) else None

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

    def register_comm_hook(self, state: Any, hook: HookFn) -> None:
        """Reduce each bucket with ``hook(state, bucket) -> Future[Tensor]`` (DDP's contract).

        The hook owns the whole reduction, division included (see ``allreduce_hook``,
        ``bf16_compress_hook``, ``fp16_compress_hook``; torch's DDP hooks work too).
        Register it once, before the first backward.

        Raises:
            RuntimeError: if a hook is already registered, a sync already happened, or the
                gradients are sharded (``shard_gradients=True`` reduce-scatters instead).
            ValueError: if ``reduce="sum"`` or ``reduce_dtype`` was set, which the hook
                would silently override.
        """
        reducer, options = self._reducer, self.options
        if isinstance(reducer.collective, CommHook):
            raise RuntimeError("register_comm_hook may be called only once")
        if reducer.sync_count or reducer.in_backward:
            raise RuntimeError("register_comm_hook must be called before the first backward")
        if not callable(hook):
            raise TypeError(f"hook must be callable, got {type(hook).__name__}")
        if options.shard_gradients:
            raise RuntimeError(
                "a comm hook owns the whole reduction, which shard_gradients=True replaces "
                "by a reduce-scatter; use one or the other"
            )
        if options.reduce != "mean" or options.reduce_dtype is not None:
            raise ValueError(
                "a comm hook owns the reduction (division and wire dtype), so "
                f"reduce={options.reduce!r} / reduce_dtype={options.reduce_dtype} would be "
                "ignored; build DataParallel with the defaults and do it in the hook"
            )
        views = options.gradient_as_bucket_view
        reducer.set_collective(CommHook(hook, state, reducer.slots, views=views))

    def sync_gradients(self) -> None:
        """Reduce the gradients now (legacy mode: call it after every backward).

        Legacy mode: reduces every bucket through the reused buffer. Overlap mode: the
        backward already synced, so this only reduces gradients accumulated under
        ``no_sync()`` since the last sync (a no-op otherwise), so one loop fits both modes.
        Inside ``no_sync()`` it does nothing, as fairseq's ``all_reduce`` does.
        """
        if self.require_backward_grad_sync:
            self._reducer.sync_gradients()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled()
        sync = self.require_backward_grad_sync
        before = f"at the start of a forward (before gradient sync #{self._reducer.sync_count})"
        if training:
            check_still_frozen(self._frozen, self.module)
            if sync and self.options.param_broadcast_period:
                with naming_peer_failures(f"the parameter broadcast {before}"):
                    self._maybe_broadcast_params()
        self._reducer.prepare_for_forward(training=training, sync=sync)
        buffers = self._buffers_to_broadcast()
        with naming_peer_failures(f"the Join status exchange {before}"):
            source = self._join_step(sync=training and sync, buffers=bool(buffers))
        if buffers:
            # A rank that runs one step more than another stops here first (a causal mask,
            # BatchNorm statistics): its peer is in a collective of its own.
            with naming_peer_failures(f"the buffer broadcast {before}"):
                broadcast_tensors(buffers, self.process_group, group_src=source)
        self._sync_buffers_next = training and sync
        output = self.module(*args, **kwargs)
        reducer = self._reducer
        if training and reducer.has_params:
            output = watch_backward(
                output,
                self._sink_anchor,
                reducer.notify_backward,
                reducer.watch_outputs,
                sink=self.world_size > 1,
            )
        return output

    def _maybe_broadcast_params(self) -> None:
        """MegEngine's ``bcast_period``: rank 0's weights every ``param_broadcast_period``."""
        syncs = self._reducer.sync_count
        if syncs - self._params_broadcast_at >= self.options.param_broadcast_period:
            broadcast_tensors([p for p in self.module.parameters()], self.process_group)
            self._params_broadcast_at = syncs

    def _buffers_to_broadcast(self) -> list[torch.Tensor]:
        if self.options.broadcast_buffers and self._sync_buffers_next and self.world_size > 1:
            return [b for _, b in self.module.named_buffers()]
        return []

    # ---- uneven inputs (torch's Join; join.py) -----------------------------------------

    def join(
        self,
        divide_by_initial_world_size: bool = True,
        enable: bool = True,
        throw_on_early_termination: bool = False,
    ) -> Join:
        """DDP's ``join()``: ``with model.join(): for batch in my_batches: ...`` ends without
        a hang when ranks have different numbers of batches (``Join([model, zero])`` joins a
        ZeRO optimizer too).

        A rank that ran out of batches shadows the collectives of every step the others
        still run, contributing zero gradients; at the end every rank gets the model of a
        rank that ran last.

        Args:
            divide_by_initial_world_size: ``True``: the mean still divides by the group size,
                so every sample weighs the same; ``False``: by the ranks still running.
            enable: ``False`` turns the context into a no-op (inputs known to be even).
            throw_on_early_termination: raise on every rank as soon as one rank runs out.

        Returns:
            A ``torch.distributed.algorithms.join.Join`` context manager.

        Example:
            >>> with model.join():  # doctest: +SKIP
            ...     for x in batches_of_this_rank:  # 3 on one rank, 5 on another
            ...         model(x).sum().backward(); opt.step(); opt.zero_grad()
        """
        return Join(
            [self],
            enable,
            throw_on_early_termination,
            divide_by_initial_world_size=divide_by_initial_world_size,
        )

    def join_hook(self, **kwargs: Any) -> DataParallelJoinHook:
        """The ``JoinHook`` that ``Join`` runs on a rank that ran out of batches
        (``divide_by_initial_world_size``, default ``True``, as in DDP).

        Raises:
            ValueError: for options whose collectives a joined rank cannot shadow: model
                parallelism (``groups``), ``param_broadcast_period`` (rank 0 may have
                joined), ``shard_gradients`` (ZeRO-2, not yet), or
                ``divide_by_initial_world_size=False`` with ``reduce_dtype`` (its division
                happens in the wire dtype, outside the Reducer).
        """
        divide = bool(kwargs.get("divide_by_initial_world_size", True))
        options = self.options
        if self.shared_plan is not None or options.param_broadcast_period:
            raise ValueError(
                "join() supports plain data parallelism only: with model-parallel groups or "
                "param_broadcast_period the ranks that ran out of batches cannot shadow the "
                "other collectives; give every rank the same number of batches instead"
            )
        if options.shard_gradients:
            raise ValueError(
                "join() does not support shard_gradients=True (ZeRO-2) yet; use "
                "ZeroRedundancyOptimizer without shard_gradients under Join([model, zero]), "
                "or give every rank the same number of batches"
            )
        if not divide and options.reduce_dtype is not None:
            raise ValueError(
                "divide_by_initial_world_size=False needs the mean's division in the copy "
                "into the bucket, which reduce_dtype moves into the wire dtype; pass "
                "divide_by_initial_world_size=True"
            )
        self._divide_by_initial_world_size = divide
        return DataParallelJoinHook(self, divide_by_initial_world_size=divide)

    @property
    def join_device(self) -> torch.device:
        """Where ``Join``'s own all-reduces run: the device of the parameters."""
        return self._device

    @property
    def join_process_group(self) -> dist.ProcessGroup:
        """The group ``Join`` counts the ranks in: the data-parallel group."""
        return self.process_group

    def _join_step(self, *, sync: bool, buffers: bool) -> int:
        """Under ``Join``, tell the joined ranks what this step does (before any of its
        collectives); returns the group rank buffers are broadcast from."""
        reducer = self._reducer
        if not self._join_config.enable:
            reducer.active_ranks = reducer.join_divisor = None
            return 0
        Join.notify_join_context(self)  # Join's count of the ranks still running
        status = exchange_status(
            self.process_group, self._device, running=True, sync=sync, buffers=buffers
        )
        reducer.active_ranks = status.active
        reducer.join_divisor = None if self._divide_by_initial_world_size else status.active
        return status.source  # DDP's authoritative rank: one still running

    def _shadow_step(self) -> None:
        """One step of the ranks still running, on a rank that joined (``Join`` calls it)."""
        status = exchange_status(
            self.process_group, self._device, running=False, sync=False, buffers=False
        )
        if status.buffers:
            buffers = [b for _, b in self.module.named_buffers()]
            broadcast_tensors(buffers, self.process_group, group_src=status.source)
        if status.sync:
            self._reducer.active_ranks = status.active
            self._reducer.shadow_sync()
