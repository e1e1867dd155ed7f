"""ZeRO-2 layout: gradients reduce-scattered into flat shards (ZeRO, arXiv:1910.02054 §5.2).

Buckets come from ``plan_buckets(..., pad_to=world_size)`` and ownership from
``plan_flat_shards``: rank ``r`` owns element range ``r`` of every bucket, which is exactly
what a reduce-scatter leaves on it. The local optimizer steps 1-D pieces of parameters, so
only elementwise optimizers give the unsharded result.
"""

from __future__ import annotations

import dataclasses
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import Bucket, BucketPlan, ParamSpec, ShardPlan, plan_buckets
from gradsync_core import plan_flat_shards as _plan_flat_shards
from gradsync_torch._collectives import finish_reduce_scatter, reduce_scatter
from gradsync_torch._zero_grads import GradientSharder
from gradsync_torch._zero_layout import (
    ALONE_BYTES,
    Broadcaster,
    GreedyLayout,
    Job,
    Piece,
    Transfer,
)

# Optimizers whose update of one element reads only that element's gradient and state
# (plus per-tensor scalars such as the step count), so stepping a slice equals stepping the
# whole tensor. Adafactor (factored moments), LBFGS, SparseAdam and Muon are not.
ELEMENTWISE = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "Rprop",
        "ASGD",
    }
)


def check_elementwise(optimizer_class: type) -> None:
    """Raise ``ValueError`` unless ``optimizer_class`` is one of torch's elementwise ones."""
    is_torch = optimizer_class.__module__.startswith("torch.optim")
    if not (is_torch and optimizer_class.__name__ in ELEMENTWISE):
        raise ValueError(
            f"gradient sharding (ZeRO-2) cuts parameters into element ranges, which is exact "
            f"only for elementwise optimizers ({', '.join(sorted(ELEMENTWISE))} from "
            f"torch.optim); {optimizer_class.__module__}.{optimizer_class.__qualname__} may "
            "read a whole tensor (a norm, factored moments), so use ZeRO-1 "
            "(shard_gradients=False), which shards whole parameters"
        )


def concat_bucket_plans(plans: Sequence[BucketPlan]) -> BucketPlan:
    """One plan holding the buckets of ``plans`` in order (re-indexed): parameters added
    with ``add_param_group`` get buckets of their own and leave the earlier ones alone."""
    buckets: list[Bucket] = []
    for plan in plans:
        for bucket in plan.buckets:
            index = len(buckets)
            slots = tuple(dataclasses.replace(s, bucket=index) for s in bucket.slots)
            buckets.append(dataclasses.replace(bucket, index=index, slots=slots))
    first = plans[0]
    return BucketPlan(
        buckets=tuple(buckets),
        cap_bytes=first.cap_bytes,
        first_cap_bytes=first.first_cap_bytes,
        align=first.align,
        pad_to=first.pad_to,
        order=first.order,
    )


def plan_flat(
    segments: Sequence[Sequence[ParamSpec]],
    groups: dict[str, int],
    *,
    world_size: int,
    cap_bytes: int,
) -> ShardPlan:
    """The ZeRO-2 plan: each segment (the constructor's groups, then each added group)
    bucketed with ``pad_to=world_size`` and cut by ``plan_flat_shards``."""
    plans = [
        plan_buckets(seg, cap_bytes=cap_bytes, pad_to=world_size)
        for seg in segments
        if any(s.requires_grad for s in seg)
    ]
    if not plans:
        return ShardPlan(kind="flat", world_size=world_size, shards=())
    plan = _plan_flat_shards(concat_bucket_plans(plans), world_size=world_size)
    shards = tuple(dataclasses.replace(s, group=groups[s.name]) for s in plan.shards)
    return dataclasses.replace(plan, shards=shards)


class FlatLayout:
    """ZeRO-2: this rank keeps gradient and state for one element range of every bucket.

    On its own, ``reduce_scatter_gradients()`` packs the local gradients of a bucket (times
    ``1/world_size``, as DDP, docs/design.md §7) into a staging buffer, reduce-scatters it into this
    rank's persistent shard and drops ``param.grad``. Under ``DataParallel(shard_gradients=
    True)`` its ``GradientSharder`` did that during backward and the pieces read its shards.
    ``sync_params()`` broadcasts every rank's updated range. With ``bucket_view`` the
    parameters are views of persistent flat buckets and the pieces views of this rank's range.

    Args:
        slot_params: the tensor of every slot in ``plan`` (by slot name).
        slot_index: the optimizer's global index of the slots it steps (a DataParallel may
            reduce parameters this optimizer does not own).
    """

    kind = "flat"

    def __init__(
        self,
        slot_params: dict[str, torch.Tensor],
        slot_index: dict[str, int],
        groups: Sequence[int],
        plan: ShardPlan,
        broadcaster: Broadcaster,
        *,
        bucket_view: bool,
        sharder: GradientSharder | None = None,
    ) -> None:
        self.plan = plan
        self.broadcaster = broadcaster
        self.bucket_view = bucket_view
        self.sharder = sharder
        self.slot_params = slot_params
        world, me = plan.world_size, broadcaster.rank
        self.params = {i: slot_params[name] for name, i in slot_index.items()}
        self.trainable = sorted({slot_index[s.name] for s in plan.shards if s.name in slot_index})
        self.pieces: list[Piece] = []
        self.grad_ranges: list[tuple[int, int, int]] = []  # (bucket, start, stop) in the shard
        self.grad_shards: list[torch.Tensor] = []
        self.buckets: list[Bucket] = []
        self.jobs: list[Job] = []
        for bucket in plan.buckets.buckets if plan.buckets is not None else ():
            first = slot_params[bucket.slots[0].name]
            dtype, device, chunk = first.dtype, first.device, bucket.numel // world
            lo, hi = me * chunk, (me + 1) * chunk
            flat = None
            if bucket_view:
                flat = torch.zeros(bucket.numel, dtype=dtype, device=device)
                for slot in bucket.slots:
                    p = slot_params[slot.name]
                    view = flat[slot.offset : slot.offset + slot.numel].view_as(p)
                    view.copy_(p.detach())
                    p.data = view
            if sharder is None:
                self.grad_shards.append(torch.zeros(chunk, dtype=dtype, device=device))
            self.buckets.append(bucket)
            for slot in bucket.slots:
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if a >= b or slot.name not in slot_index:
                    continue
                index = slot_index[slot.name]
                # The local optimizer steps a view of the parameter itself (or of its bucket
                # view): no copy in or out of a separate shard.
                tensor = flat[a:b] if flat is not None else _flat_view(slot_params[slot.name])
                if flat is None:
                    tensor = tensor[a - slot.offset : b - slot.offset]
                self.pieces.append(
                    Piece(
                        index=index,
                        group=groups[index],
                        start=a - slot.offset,
                        stop=b - slot.offset,
                        tensor=tensor,
                        whole=False,
                    )
                )
                self.grad_ranges.append((bucket.index, a - lo, b - lo))
            self.jobs += self._sync_jobs(bucket, flat, chunk, dtype, device)
        self.reduced = False
        self.consumed = sharder.syncs if sharder is not None else 0

    def _sync_jobs(
        self,
        bucket: Bucket,
        flat: torch.Tensor | None,
        chunk: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[Job]:
        """Broadcast every rank's range of ``bucket`` from its owner. With bucket views: each
        range in place. Otherwise each large piece in place (the owner stepped the
        parameter's own memory), and the small pieces of a range packed together."""
        world = self.plan.world_size
        if flat is not None:
            transfers = [
                Transfer(r, chunk, lambda _, r=r: flat[r * chunk : (r + 1) * chunk])
                for r in range(world)
            ]
            return [Job(transfers, 0, dtype, device)]
        jobs, itemsize = [], torch.empty(0, dtype=dtype).element_size()
        for r in range(world):
            lo, hi = r * chunk, (r + 1) * chunk
            small: list[torch.Tensor] = []
            for slot in bucket.slots:
                a, b = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
                if a >= b:
                    continue
                view = _flat_view(self.slot_params[slot.name])
                piece = view[a - slot.offset : b - slot.offset]
                if (b - a) * itemsize < ALONE_BYTES:
                    small.append(piece)
                else:
                    jobs.append(Job([Transfer(r, b - a, lambda _, t=piece: t)], 0, dtype, device))
            if small:
                jobs.append(self._packed_job(r, small, dtype, device))
        return jobs

    def _packed_job(
        self, src: int, pieces: list[torch.Tensor], dtype: torch.dtype, device: torch.device
    ) -> Job:
        numel = sum(t.numel() for t in pieces)
        me = self.broadcaster.rank

        def pack(buffer: torch.Tensor | None) -> None:
            if src == me:
                torch.cat(pieces, out=buffer)

        def unpack(buffer: torch.Tensor | None) -> None:
            if src != me:
                offset = 0
                for piece in pieces:
                    piece.copy_(buffer[offset : offset + piece.numel()])
                    offset += piece.numel()

        return Job(
            [Transfer(src, numel, lambda buffer: buffer)], numel, dtype, device, pack, unpack
        )

    def reduce_scatter_gradients(self) -> None:
        """Reduce-scatter every bucket's gradients into this rank's shard; drop ``.grad``."""
        if self.sharder is not None:
            raise RuntimeError(
                "DataParallel(shard_gradients=True) already reduce-scatters the gradients "
                "during backward; do not call reduce_scatter_gradients()"
            )
        world, comm = self.plan.world_size, self.broadcaster
        has_grad = torch.tensor(
            [self.params[i].grad is not None for i in self.trainable], dtype=torch.uint8
        )
        if world > 1 and has_grad.numel():
            # A parameter no rank computed a gradient for is skipped, as by a plain
            # optimizer; one that some ranks skipped contributes their zeros (docs/design.md §7).
            dist.all_reduce(has_grad, op=dist.ReduceOp.MAX, group=comm.group)
        stepped = {i for i, h in zip(self.trainable, has_grad.tolist(), strict=True) if h}
        in_flight: deque[tuple[torch.Tensor, torch.Tensor, list[Any]]] = deque()
        for b, bucket in enumerate(self.buckets):
            while len(in_flight) >= 2:
                finish_reduce_scatter(*in_flight.popleft(), comm.group, comm.rank, world)
            first = self.slot_params[bucket.slots[0].name]
            send = comm.staging((first.dtype, first.device), b % 2, bucket.numel)
            for slot in bucket.slots:
                grad = self.slot_params[slot.name].grad
                view = send[slot.offset : slot.offset + slot.numel]
                if grad is None:
                    view.zero_()
                else:
                    torch.div(grad.reshape(-1), world, out=view)  # DataParallel's arithmetic
            end = bucket.slots[-1].offset + bucket.slots[-1].numel
            send[end:].zero_()
            shard = self.grad_shards[b]
            in_flight.append((send, shard, reduce_scatter(send, shard, comm.group, world)))
        while in_flight:
            finish_reduce_scatter(*in_flight.popleft(), comm.group, comm.rank, world)
        for i in self.trainable:
            self.params[i].grad = None  # each rank keeps only its shard (ZeRO-2)
        self._attach_grads(lambda index: index in stepped, self.grad_shards)
        self.reduced = True

    def _attach_grads(self, used: Any, shards: Any) -> None:
        for piece, (b, lo, hi) in zip(self.pieces, self.grad_ranges, strict=True):
            piece.tensor.grad = shards[b][lo:hi] if used(piece.index) else None

    def before_step(self) -> None:
        """Attach this step's gradient shards to the pieces (reduce-scattering first if the
        optimizer runs on its own)."""
        sharder = self.sharder
        if sharder is not None:
            if sharder.syncs == self.consumed:  # no synced backward since the last step
                self._attach_grads(lambda index: False, None)
            else:
                if sharder.synced != tuple(self.buckets):
                    raise RuntimeError(
                        "DataParallel reduced gradients with another bucket layout than the "
                        "optimizer was built for; build the optimizer after wrapping the model"
                    )
                used = sharder.used
                self._attach_grads(
                    lambda index: used.get(id(self.params[index]), False), sharder.shards
                )
                self.consumed = sharder.syncs
        elif not self.reduced:
            self.reduce_scatter_gradients()

    def sync_params(self) -> None:
        self.broadcaster.run(self.jobs)
        self.reduced = False

    def drop_gradients(self) -> None:
        for piece in self.pieces:
            piece.tensor.grad = None
        self.reduced = False

    @property
    def grad_nbytes(self) -> int:
        shards = self.grad_shards if self.sharder is None else self.sharder.shards.values()
        return sum(g.numel() * g.element_size() for g in shards)


def _flat_view(param: torch.Tensor) -> torch.Tensor:
    """The parameter's memory as one flat view, which pieces and broadcasts write into."""
    if not param.is_contiguous():
        raise ValueError(
            f"gradient sharding steps views of each parameter's memory, but a parameter of "
            f"shape {tuple(param.shape)} is not contiguous; make it contiguous before building "
            "the optimizer"
        )
    return param.detach().view(-1)


def rename_plan(plan: ShardPlan, names: dict[str, str], groups: dict[str, int]) -> ShardPlan:
    """``plan`` with parameters renamed by ``names`` and shard groups set by ``groups``
    (parameters missing from them keep theirs): DataParallel's names are the module's,
    a checkpoint's are the optimizer's."""
    buckets = plan.buckets
    if buckets is not None:
        renamed = tuple(
            dataclasses.replace(
                b,
                slots=tuple(
                    dataclasses.replace(s, name=names.get(s.name, s.name)) for s in b.slots
                ),
            )
            for b in buckets.buckets
        )
        buckets = dataclasses.replace(buckets, buckets=renamed)
    shards = tuple(
        dataclasses.replace(s, name=names.get(s.name, s.name), group=groups.get(s.name, s.group))
        for s in plan.shards
    )
    return dataclasses.replace(plan, shards=shards, buckets=buckets)


def make_layout(
    params: Sequence[torch.Tensor],
    groups: Sequence[int],
    specs: Sequence[ParamSpec],
    plan: ShardPlan,
    broadcaster: Broadcaster,
    *,
    flat: bool,
    sharder: GradientSharder | None,
    cap_bytes: int,
    bucket_view: bool,
) -> GreedyLayout | FlatLayout:
    """The layout for ``plan``: greedy (ZeRO-1), flat on its own, or flat over the buckets
    of a sharding DataParallel (whose slots carry the module's names: mapped to ours)."""
    if not flat:
        return GreedyLayout(
            params, groups, specs, plan, broadcaster, cap_bytes=cap_bytes, bucket_view=bucket_view
        )
    slot_params = {s.name: p for s, p in zip(specs, params, strict=True)}
    if sharder is not None:
        ours = {id(p): s.name for s, p in zip(specs, params, strict=True)}
        slot_params = {ours.get(id(p), n): p for n, p in sharder.params_by_name().items()}
    return FlatLayout(
        slot_params,
        {s.name: i for i, s in enumerate(specs)},
        groups,
        plan,
        broadcaster,
        bucket_view=bucket_view,
        sharder=sharder,
    )
