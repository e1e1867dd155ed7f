"""Where a ZeRO rank's optimizer state lives and how parameters travel after its step.

Two layouts, both driven by gradsync_core plans (ZeRO, arXiv:1910.02054):

- ``GreedyLayout`` (ZeRO-1): each rank owns whole parameters (``plan_greedy_shards``); its
  local optimizer steps the real parameters; afterwards every rank's parameters are
  broadcast from their owner.
- ``FlatLayout`` (ZeRO-2, in ``_zero_flat``): each rank owns one contiguous element range of
  every padded bucket (``plan_flat_shards``); gradients are reduce-scattered into it.

A layout exposes its ``pieces`` (what the local optimizer steps, in model space: parameter
index and element range) and a ``sync_params()`` that makes every replica equal again.

Why broadcast and not all-gather: on gloo (this project's CPU backend) one broadcast per
rank-bucket moved 100 MB between 2 ranks in ~33 ms, ``all_gather`` took ~105-165 ms and
``all_gather_into_tensor`` ~215 ms; torch's one broadcast per parameter took ~85 ms.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import ParamSpec, ShardPlan, plan_buckets

# Staging buffers per dtype: one broadcast while the previous one is packed or unpacked.
_STAGING_BUFFERS = 2
# Collectives queued at once (in-place ones need no staging buffer).
_MAX_IN_FLIGHT = 8
# A parameter at least this large is broadcast alone, in place: copying it into a staging
# bucket and out again costs more than the extra collective.
ALONE_BYTES = 1024 * 1024


@dataclass(eq=False, slots=True)
class Piece:
    """A tensor the local optimizer steps: elements ``[start, stop)`` of parameter ``index``
    (flattened), in model space. ``tensor`` is the parameter itself when it is whole."""

    index: int  # global parameter index (param groups flattened, as torch's state_dict)
    group: int
    start: int
    stop: int
    tensor: torch.Tensor
    whole: bool

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(eq=False, slots=True)
class Transfer:
    """One collective of a parameter sync: ``src`` (group rank) broadcasts ``view(buffer)``."""

    src: int
    numel: int
    view: Callable[[torch.Tensor | None], torch.Tensor]


@dataclass(eq=False, slots=True)
class Job:
    """Transfers that share one staging buffer, with the copies around them.

    ``pack(buffer)`` runs before the transfers, ``unpack(buffer)`` after all of them;
    ``staging`` is the buffer length (0: the job broadcasts persistent tensors in place).
    """

    transfers: list[Transfer]
    staging: int
    dtype: torch.dtype
    device: torch.device
    pack: Callable[[torch.Tensor | None], None] | None = None
    unpack: Callable[[torch.Tensor | None], None] | None = None


@dataclass(eq=False)
class Broadcaster:
    """Runs sync jobs on a process group, two in flight, reusing staging buffers."""

    group: Any
    rank: int
    world_size: int
    max_in_flight: int = _MAX_IN_FLIGHT
    _staging: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = field(
        default_factory=dict
    )

    def global_rank(self, group_rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def run(self, jobs: Sequence[Job]) -> None:
        if self.world_size == 1:
            return
        in_flight: deque[list[Any]] = deque()  # [job, buffer, handles, done]
        slot_user: dict[tuple[torch.dtype, torch.device, int], list[Any]] = {}
        next_slot: dict[tuple[torch.dtype, torch.device], int] = {}
        for job in jobs:
            while len(in_flight) >= self.max_in_flight:
                self._finish(in_flight.popleft())
            buffer = None
            if job.staging:
                key = (job.dtype, job.device)
                slot = next_slot.get(key, 0)
                next_slot[key] = (slot + 1) % _STAGING_BUFFERS
                user = slot_user.get((*key, slot))
                while user is not None and not user[3]:  # the buffer is still in use
                    self._finish(in_flight.popleft())
                buffer = self.staging(key, slot, job.staging)
            if job.pack is not None:
                job.pack(buffer)
            handles = [
                dist.broadcast(
                    t.view(buffer), src=self.global_rank(t.src), group=self.group, async_op=True
                )
                for t in job.transfers
            ]
            entry = [job, buffer, handles, False]
            if job.staging:
                slot_user[(job.dtype, job.device, slot)] = entry
            in_flight.append(entry)
        while in_flight:
            self._finish(in_flight.popleft())

    @staticmethod
    def _finish(entry: list[Any]) -> None:
        job, buffer, handles, _ = entry
        for handle in handles:
            handle.wait()
        if job.unpack is not None:
            job.unpack(buffer)
        entry[3] = True

    def staging(self, key: tuple[torch.dtype, torch.device], slot: int, numel: int) -> torch.Tensor:
        """Reusable buffer ``slot`` of at least ``numel`` elements (kept between steps)."""
        pool = self._staging.setdefault(key, [])
        while len(pool) <= slot:
            pool.append(torch.empty(0, dtype=key[0], device=key[1]))
        if pool[slot].numel() < numel:
            pool[slot] = torch.empty(numel, dtype=key[0], device=key[1])
        return pool[slot][:numel]


def flat_views(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``buffer`` shaped like ``tensors``, packed back to back."""
    views, offset = [], 0
    for t in tensors:
        views.append(buffer[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


class GreedyLayout:
    """ZeRO-1: this rank steps the whole parameters it owns; owners broadcast afterwards.

    Each rank's owned parameters are packed into buckets of at most ``cap_bytes`` (the last
    parameter may overflow, as DDP's rule) by ``plan_buckets``, so a sync is a few large
    broadcasts instead of one per parameter. With ``bucket_view`` the parameters become
    views of persistent flat buckets (torch's ``parameters_as_bucket_view``) and the
    broadcast needs no copy; otherwise a bucket is packed into a staging buffer, and a
    bucket of one parameter is broadcast in place.
    """

    kind = "greedy"

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        groups: Sequence[int],
        specs: Sequence[ParamSpec],
        plan: ShardPlan,
        broadcaster: Broadcaster,
        *,
        cap_bytes: int,
        bucket_view: bool,
    ) -> None:
        self.plan = plan
        self.broadcaster = broadcaster
        index_of = {spec.name: i for i, spec in enumerate(specs)}
        owned = [[index_of[s.name] for s in plan.shards_of(r)] for r in range(plan.world_size)]
        me = broadcaster.rank
        self.pieces = [
            Piece(
                index=i,
                group=groups[i],
                start=0,
                stop=params[i].numel(),
                tensor=params[i],
                whole=True,
            )
            for i in sorted(owned[me])
        ]
        per_rank: list[list[Job]] = [[] for _ in owned]
        self.flat_buckets: list[torch.Tensor] = []
        for rank, indices in enumerate(owned):
            rank_specs = [specs[i] for i in indices]
            alone = [s for s in rank_specs if s.nbytes >= ALONE_BYTES and not bucket_view]
            packed = [s for s in rank_specs if s.nbytes < ALONE_BYTES or bucket_view]
            for spec in alone:
                per_rank[rank].append(self._job(rank, [params[index_of[spec.name]]], bucket_view))
            for bucket in plan_buckets(packed, cap_bytes=cap_bytes).buckets:
                members = [params[index_of[slot.name]] for slot in bucket.slots]
                per_rank[rank].append(self._job(rank, members, bucket_view))
        # Owners take turns, so every rank sends and receives at once (both directions of
        # each link busy) instead of the ranks broadcasting one after another.
        rounds = itertools.zip_longest(*per_rank)
        self.jobs = [job for jobs in rounds for job in jobs if job is not None]

    def _job(self, src: int, members: list[torch.Tensor], bucket_view: bool) -> Job:
        numel = sum(p.numel() for p in members)
        dtype, device = members[0].dtype, members[0].device
        if bucket_view:
            flat = torch.empty(numel, dtype=dtype, device=device)
            for p, view in zip(members, flat_views(flat, members), strict=True):
                view.copy_(p.detach())
                p.data = view  # torch's parameters_as_bucket_view: params live in the bucket
            self.flat_buckets.append(flat)
            return Job([Transfer(src, numel, lambda _: flat)], 0, dtype, device)
        if len(members) == 1 and members[0].is_contiguous():
            only = members[0]
            return Job([Transfer(src, numel, lambda _: only.detach())], 0, dtype, device)
        me = self.broadcaster.rank
        detached = [p.detach() for p in members]

        def pack(buffer: torch.Tensor | None) -> None:
            if src == me:
                torch.cat([p.reshape(-1) for p in detached], out=buffer)

        def unpack(buffer: torch.Tensor | None) -> None:
            if src != me:
                for p, view in zip(detached, flat_views(buffer, detached), strict=True):
                    p.copy_(view)

        return Job(
            [Transfer(src, numel, lambda buffer: buffer)], numel, dtype, device, pack, unpack
        )

    def before_step(self) -> None:
        """Nothing to do: the local optimizer steps the parameters themselves."""

    def sync_params(self) -> None:
        self.broadcaster.run(self.jobs)

    @property
    def numel(self) -> int:
        return sum(piece.numel for piece in self.pieces)


def state_nbytes(state: dict[Any, dict[str, Any]]) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (what ZeRO divides by the ranks)."""
    return sum(
        v.numel() * v.element_size()
        for per_param in state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def numel_of(shape: Sequence[int]) -> int:
    return math.prod(shape)


def check_same_plan(
    plan: ShardPlan, specs: Sequence[ParamSpec], group: Any, world_size: int
) -> None:
    """Every rank must hold the same plan, or the sync collectives mismatch and hang
    (docs/design.md §8): one small all-gather of fingerprints, and the specs only on a mismatch.

    Raises:
        ValueError: naming a differing rank and the first differing parameter.
    """
    if world_size == 1:
        return
    prints: list[Any] = [None] * world_size
    dist.all_gather_object(prints, plan.fingerprint, group=group)
    if len(set(prints)) == 1:
        return
    tables: list[Any] = [None] * world_size
    mine = [(s.name, s.shape, s.dtype, s.requires_grad) for s in specs]
    dist.all_gather_object(tables, mine, group=group)
    other = next(r for r in range(world_size) if prints[r] != prints[0])
    diff = next(
        (
            f"parameter #{i}: {a} vs {b}"
            for i, (a, b) in enumerate(zip(tables[0], tables[other], strict=False))
            if a != b
        ),
        f"{len(tables[0])} vs {len(tables[other])} parameters",
    )
    raise ValueError(
        f"ranks 0 and {other} built different ZeRO plans ({diff}); every rank must pass "
        "the same parameters, in the same order, with the same requires_grad"
    )
