"""ZeRO-1's layout: each rank owns whole parameters and broadcasts them after its step.

Owners from ``plan_greedy_shards`` (ZeRO arXiv:1910.02054 §5.1); the local optimizer steps the
real parameters, and afterwards every rank's parameters are broadcast from their owner (the
``Layout`` protocol is in ``layout``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import torch

from gradsync_core import ParamSpec, ShardPlan, plan_buckets
from gradsync_torch.zero.broadcast import (
    ALONE_BYTES,
    Broadcaster,
    Job,
    Piece,
    Transfer,
    flat_views,
    staged,
)


class GreedyLayout:
    """ZeRO-1: this rank steps the whole parameters it owns; owners broadcast afterwards.

    Each rank's owned parameters are packed into buckets of at most ``cap_bytes`` (the last
    parameter may overflow, as DDP's rule) by ``plan_buckets``, so a sync is a few large
    broadcasts instead of one per parameter. With ``bucket_view`` the parameters become
    views of persistent flat buckets (torch's ``parameters_as_bucket_view``) and the
    broadcast needs no copy; otherwise a bucket is packed into a staging buffer, and a
    bucket of one parameter is broadcast in place.
    """

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
        self.params = list(params)
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
        job = self._transfer_job(src, members, bucket_view)
        if src == self.broadcaster.rank:
            job.owned = members  # stepped here right before they are sent (sync_params)
        return job

    def _transfer_job(self, src: int, members: list[torch.Tensor], bucket_view: bool) -> Job:
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
                for p, view in zip(detached, flat_views(staged(buffer), detached), strict=True):
                    p.copy_(view)

        return Job([Transfer(src, numel, staged)], numel, dtype, device, pack, unpack)

    def before_step(self) -> None:
        """Nothing to do: the local optimizer steps the parameters themselves."""

    @property
    def grad_nbytes(self) -> int:
        """Bytes of ``param.grad`` memory held now (every parameter, owned or not; grads
        that are views of one bucket count it once)."""
        storages = {}
        for p in self.params:
            if p.grad is not None:
                storage = p.grad.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        return sum(storages.values())

    def sync_params(self, step: Callable[[Job], None] | None = None) -> None:
        """Broadcast every parameter from its owner. With ``step``, the local step happens
        here, one job at a time: ``step(job)`` must step exactly ``job.owned``, and runs
        right before their broadcast, so the parameters already sent (and those being
        received) travel while later ones are stepped."""
        self.broadcaster.run(self.jobs, step)
