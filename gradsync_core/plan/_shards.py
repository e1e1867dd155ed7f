"""Shard partitions: which rank owns which optimizer state (ZeRO-1/2).

See docs/design.md §4; ZeRO: arXiv:1910.02054.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradsync_core.plan._buckets import BucketPlan, check_distinct_renames
from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._specs import ParamSpec, check_unique_names


@dataclass(frozen=True, slots=True, kw_only=True)
class Shard:
    """Elements ``[start, stop)`` of parameter ``name`` (flattened), owned by ``rank``."""

    name: str
    rank: int
    start: int
    stop: int
    group: int  # optimizer param group index

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """Which rank owns which optimizer state.

    ``kind == "greedy"``: whole parameters (ZeRO-1, torch's ``ZeroRedundancyOptimizer``);
    every shard spans its parameter. ``kind == "flat"``: each bucket of ``buckets`` cut into
    ``world_size`` equal element ranges, the layout ``reduce_scatter`` delivers; a parameter
    may be split between neighbouring ranks.
    """

    kind: str
    world_size: int
    shards: tuple[Shard, ...]
    buckets: BucketPlan | None = None  # the layout a flat plan cuts

    def shards_of(self, rank: int) -> tuple[Shard, ...]:
        return tuple(shard for shard in self.shards if shard.rank == rank)

    def owner(self, name: str) -> int:
        """The rank that owns parameter ``name`` (greedy plans only)."""
        if self.kind != "greedy":
            raise ValueError("owner() needs a greedy plan; a flat plan splits parameters")
        for shard in self.shards:
            if shard.name == name:
                return shard.rank
        raise KeyError(f"parameter {name!r} has no owner in this plan (frozen or unknown)")

    @property
    def rank_numel(self) -> tuple[int, ...]:
        """Owned elements per rank, padding excluded."""
        loads = [0] * self.world_size
        for shard in self.shards:
            loads[shard.rank] += shard.numel
        return tuple(loads)

    @property
    def imbalance(self) -> float:
        """``max_load / mean_load - 1``: 0.0 is perfect balance."""
        loads = self.rank_numel
        total = sum(loads)
        return max(loads) * len(loads) / total - 1.0 if total else 0.0

    @property
    def padding_numel(self) -> int:
        """Elements each collective carries beyond the gradients (flat plans; 0 for greedy)."""
        if self.buckets is None:
            return 0
        return sum(bucket.numel - bucket.used_numel for bucket in self.buckets.buckets)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "shard_plan",
            "version": PLAN_VERSION,
            "partition": self.kind,
            "world_size": self.world_size,
            "shards": [[s.name, s.rank, s.start, s.stop, s.group] for s in self.shards],
            "buckets": None if self.buckets is None else self.buckets.to_json(),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ShardPlan:
        check_header(obj, "shard_plan")
        return cls(
            kind=obj["partition"],
            world_size=obj["world_size"],
            shards=tuple(
                Shard(name=name, rank=rank, start=start, stop=stop, group=group)
                for name, rank, start, stop, group in obj["shards"]
            ),
            buckets=None if obj["buckets"] is None else BucketPlan.from_json(obj["buckets"]),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())

    def renamed(
        self,
        names: Mapping[str, str],
        groups: Mapping[str, int] | None = None,
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> ShardPlan:
        """This plan with parameters renamed by ``names`` (old -> new), the param-group index
        of each shard set by ``groups`` (old name -> group) and, in the embedded bucket plan,
        slots renamed and reshaped by ``shapes`` (``BucketPlan.renamed``); a parameter
        missing from a mapping keeps its name, group or shape.

        One rename for both the shards and the layout they cut, so the plan stays one
        statement: a JAX flat plan renamed to torch names and shapes is the plan torch
        makes for the twin module (same fingerprint).

        Raises:
            ValueError: if two parameters get one name, or a new shape has another element
                count.

        Example:
            >>> plan = plan_greedy_shards([ParamSpec(name="k", shape=(3,))], world_size=1)
            >>> [s.name for s in plan.renamed({"k": "w"}).shards]
            ['w']
        """
        groups = groups or {}
        owned = dict.fromkeys(shard.name for shard in self.shards)  # a flat plan splits some
        check_distinct_renames([names.get(name, name) for name in owned])
        shards = tuple(
            replace(s, name=names.get(s.name, s.name), group=groups.get(s.name, s.group))
            for s in self.shards
        )
        buckets = None if self.buckets is None else self.buckets.renamed(names, shapes=shapes)
        return replace(self, shards=shards, buckets=buckets)


def _check_world_size(world_size: int) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")


def plan_greedy_shards(
    param_groups: Sequence[Sequence[ParamSpec]] | Sequence[ParamSpec], *, world_size: int
) -> ShardPlan:
    """Whole-parameter ownership, exactly as ``torch.distributed.optim.ZeroRedundancyOptimizer``.

    For each param group in order, its trainable parameters are stable-sorted by numel,
    largest first, and each goes to the rank with the smallest running total (ties: the
    lowest rank). Totals carry across groups. Frozen parameters get no owner: they have no
    optimizer state (torch's optimizer would balance them too, so pass trainable ones only
    when comparing with it).

    Args:
        param_groups: a list of param groups (each a list of specs), or one flat list.
        world_size: ranks that share the optimizer state (the data-parallel size).

    Example:
        >>> specs = [ParamSpec(name=n, shape=(s,)) for n, s in [("a", 5), ("b", 3), ("c", 3)]]
        >>> plan = plan_greedy_shards(specs, world_size=2)
        >>> plan.owner("a"), plan.owner("b"), plan.owner("c")
        (0, 1, 1)
    """
    _check_world_size(world_size)
    if param_groups and isinstance(param_groups[0], ParamSpec):
        groups: Sequence[Sequence[ParamSpec]] = [param_groups]  # type: ignore[list-item]
    else:
        groups = param_groups  # type: ignore[assignment]
    check_unique_names([spec for group in groups for spec in group])
    # A heap of (load, rank) pops the smallest load and, on ties, the lowest rank: torch's
    # ``_get_min_index`` rule in O(log world_size) per parameter.
    loads = [(0, rank) for rank in range(world_size)]
    shards = []
    for group_index, group in enumerate(groups):
        trainable_specs = [spec for spec in group if spec.requires_grad]
        for spec in sorted(trainable_specs, key=lambda s: s.numel, reverse=True):
            load, rank = loads[0]
            shards.append(
                Shard(name=spec.name, rank=rank, start=0, stop=spec.numel, group=group_index)
            )
            heapq.heapreplace(loads, (load + spec.numel, rank))
    return ShardPlan(kind="greedy", world_size=world_size, shards=tuple(shards))


def plan_flat_shards(buckets: BucketPlan, *, world_size: int) -> ShardPlan:
    """Cut every bucket into ``world_size`` equal contiguous element ranges.

    Rank ``i`` owns chunk ``i`` of each bucket: what ``reduce_scatter`` and
    ``lax.psum_scatter(tiled=True)`` leave on it. Exact only for elementwise optimizers.

    Raises:
        ValueError: if a bucket's length is not a multiple of ``world_size`` (plan the
            buckets with ``pad_to`` a multiple of it).

    Example:
        >>> from gradsync_core import plan_buckets
        >>> specs = [ParamSpec(name="w", shape=(4,)), ParamSpec(name="b", shape=(3,))]
        >>> plan = plan_flat_shards(plan_buckets(specs, pad_to=2), world_size=2)
        >>> [(s.name, s.rank, s.start, s.stop) for s in plan.shards]
        [('w', 0, 0, 4), ('b', 1, 0, 3)]
    """
    _check_world_size(world_size)
    shards = []
    for bucket in buckets.buckets:
        if bucket.numel % world_size:
            raise ValueError(
                f"bucket {bucket.index} has {bucket.numel} elements, not a multiple of "
                f"world_size {world_size}; plan the buckets with pad_to={world_size} "
                "(or a multiple of it)"
            )
        chunk = bucket.numel // world_size
        for slot in bucket.slots:
            end = slot.offset + slot.numel
            first_rank = min(slot.offset // chunk, world_size - 1) if chunk else 0
            if slot.numel == 0:  # an empty parameter still gets one (empty) owner
                shards.append(Shard(name=slot.name, rank=first_rank, start=0, stop=0, group=0))
                continue
            for rank in range(first_rank, world_size):
                lo, hi = max(slot.offset, rank * chunk), min(end, (rank + 1) * chunk)
                if lo >= hi:
                    break
                shards.append(
                    Shard(
                        name=slot.name,
                        rank=rank,
                        start=lo - slot.offset,
                        stop=hi - slot.offset,
                        group=0,
                    )
                )
    return ShardPlan(kind="flat", world_size=world_size, shards=tuple(shards), buckets=buckets)
