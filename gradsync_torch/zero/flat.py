"""ZeRO-2 layout: gradients reduce-scattered into flat shards (ZeRO, arXiv:1910.02054 §5.2).

Buckets come from ``plan_buckets(..., pad_to=world_size)`` and ownership from
``plan_flat_shards``: rank ``r`` owns element range ``r`` of every bucket, which is exactly
what a reduce-scatter leaves on it. The local optimizer steps 1-D pieces of parameters, so
only elementwise optimizers give the unsharded result.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import Bucket, ShardPlan
from gradsync_torch._collectives import ReduceScatterWork, reduce_scatter_into
from gradsync_torch.data_parallel import ReduceScatter
from gradsync_torch.zero.broadcast import ALONE_BYTES, Broadcaster, Job, Piece, Transfer, staged


class FlatLayout:
    """ZeRO-2: this rank keeps gradient and state for one element range of every bucket.

    On its own, ``reduce_scatter_gradients()`` packs the local gradients of a bucket (times
    ``1/world_size``, as DDP, docs/design.md §7) into a staging buffer, reduce-scatters it into this
    rank's persistent shard and drops ``param.grad``. Under ``DataParallel(shard_gradients=
    True)`` its ``ReduceScatter`` did that during backward and the pieces read its shards.
    ``sync_params()`` broadcasts every rank's updated range. With ``bucket_view`` the
    parameters are views of persistent flat buckets and the pieces views of this rank's range.

    Args:
        slot_params: the tensor of every slot in ``plan`` (by slot name).
        slot_index: the optimizer's global index of the slots it steps (a DataParallel may
            reduce parameters this optimizer does not own).
    """

    def __init__(
        self,
        slot_params: dict[str, torch.Tensor],
        slot_index: dict[str, int],
        groups: Sequence[int],
        plan: ShardPlan,
        broadcaster: Broadcaster,
        *,
        bucket_view: bool,
        sharder: ReduceScatter | None = None,
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
            first_piece = len(self.pieces)
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
            jobs = self._sync_jobs(bucket, flat, chunk, dtype, device)
            # Stepped before the bucket's first broadcast, which precedes this rank's own.
            jobs[0].owned = [piece.tensor for piece in self.pieces[first_piece:]]
            self.jobs += jobs
        # Whether this step's gradients are attached to the pieces (reduce-scattered by the
        # optimizer on its own, or read from the sharder's shards): until sync_params or
        # drop_gradients.
        self.attached = False
        self.consumed = sharder.sync_count if sharder is not None else 0

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
        parameter's own memory), and the small pieces of a range packed together; the owners
        take turns (as ZeRO-1's jobs), so every rank sends and receives at once instead of
        the ranges crossing the links one owner after another."""
        world = self.plan.world_size
        if flat is not None:
            transfers = [
                Transfer(r, chunk, _fixed(flat[r * chunk : (r + 1) * chunk])) for r in range(world)
            ]
            return [Job(transfers, 0, dtype, device)]
        per_rank: list[list[Job]] = [[] for _ in range(world)]
        itemsize = torch.empty(0, dtype=dtype).element_size()
        for r in range(world):
            jobs = per_rank[r]
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
                    jobs.append(Job([Transfer(r, b - a, _fixed(piece))], 0, dtype, device))
            if small:
                jobs.append(self._packed_job(r, small, dtype, device))
        turns = itertools.zip_longest(*per_rank)
        return [job for turn in turns for job in turn if job is not None]

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
                    piece.copy_(staged(buffer)[offset : offset + piece.numel()])
                    offset += piece.numel()

        return Job([Transfer(src, numel, staged)], numel, dtype, device, pack, unpack)

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
        in_flight: deque[ReduceScatterWork] = deque()
        for b, bucket in enumerate(self.buckets):
            while len(in_flight) >= 2:
                in_flight.popleft().wait()
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
            in_flight.append(reduce_scatter_into(shard, send, comm.group, tag=b))
        while in_flight:
            in_flight.popleft().wait()
        for i in self.trainable:
            self.params[i].grad = None  # each rank keeps only its shard (ZeRO-2)
        self._attach_grads(lambda index: index in stepped, self.grad_shards)
        self.attached = True

    def _attach_grads(self, used: Any, shards: Any) -> None:
        for piece, (b, lo, hi) in zip(self.pieces, self.grad_ranges, strict=True):
            piece.tensor.grad = shards[b][lo:hi] if used(piece.index) else None

    def before_step(self) -> None:
        """Attach this step's gradient shards to the pieces (reduce-scattering first if the
        optimizer runs on its own). Idempotent until the step's ``sync_params`` (or
        ``drop_gradients``), so ``clip_grad_norm_`` may attach them before ``step`` does."""
        sharder = self.sharder
        if sharder is None:
            if not self.attached:
                self.reduce_scatter_gradients()
            return
        if self.attached and sharder.sync_count == self.consumed:
            return  # attached already, and no sync since
        if sharder.sync_count == self.consumed:  # no synced backward since the last step
            self._attach_grads(lambda index: False, None)
        else:
            if sharder.last_sync_buckets != tuple(self.buckets):
                raise RuntimeError(
                    "DataParallel reduced gradients with another bucket layout than the "
                    "optimizer was built for; build the optimizer after wrapping the model"
                )
            used = sharder.used
            self._attach_grads(
                lambda index: used.get(id(self.params[index]), False), sharder.shards
            )
            self.consumed = sharder.sync_count
        self.attached = True

    def local_gradients(self) -> list[torch.Tensor]:
        """This step's gradients of this rank's pieces (attached first if need be): together
        with every other rank's, each element of every stepped gradient exactly once."""
        self.before_step()
        return [piece.tensor.grad for piece in self.pieces if piece.tensor.grad is not None]

    def sync_params(self, step: Callable[[Job], None] | None = None) -> None:
        """Broadcast every rank's range of every bucket; with ``step``, step this rank's
        pieces of each bucket (``job.owned``) right before the bucket's broadcasts."""
        self.broadcaster.run(self.jobs, step)
        self.attached = False

    def drop_gradients(self) -> None:
        for piece in self.pieces:
            piece.tensor.grad = None
        self.attached = False

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


def _fixed(tensor: torch.Tensor) -> Callable[[torch.Tensor | None], torch.Tensor]:
    """The view of a transfer that broadcasts ``tensor`` in place (its job stages nothing)."""
    return lambda _: tensor
