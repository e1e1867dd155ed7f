"""Where ZeRO-3 optimizer state goes in a checkpoint: each rank's dim-0 rows, as element ranges.

Under parameter sharding (ZeRO-3, ``ParamShardPlan``) a rank holds rows ``[start, stop)`` of
every parameter and the optimizer state of exactly those rows. A checkpoint stores state in
model space, per rank file, as the manifest's ``ShardPlan`` says (docs/design.md §9): rows
``[start, stop)`` of a row-major tensor are its flattened elements
``[start * row, stop * row)``, so the ZeRO-3 partition is a ``ShardPlan`` of kind ``"dim0"``
whose shards are those element ranges (``ParamChunk.element_range``), padding stripped, empty
chunks left out. Every reader that joins flat (ZeRO-2) slices reads it unchanged, at any world
size and in either framework.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync_core.plan._param_shards import plan_param_shards
from gradsync_core.plan._shards import Shard, ShardPlan
from gradsync_core.plan._specs import ParamSpec

DIM0 = "dim0"  # the ShardPlan kind of a ZeRO-3 checkpoint


def plan_dim0_shards(
    specs: Sequence[ParamSpec], groups: Sequence[int], *, shard_size: int
) -> ShardPlan:
    """The checkpoint partition of ZeRO-3 optimizer state over ``shard_size`` ranks.

    Args:
        specs: the optimizer's parameters (whole shapes), in its global index order.
        groups: each parameter's optimizer param-group index.
        shard_size: the ranks the parameters are cut over (FSDP2's mesh size).

    Returns:
        A ``ShardPlan`` of kind ``"dim0"``: for each trainable parameter and each rank whose
        chunk (``chunk_rows``, FSDP2's cut) is not empty, that chunk's element range.

    Raises:
        ValueError: a 0-d parameter (never sharded), or ``groups`` of another length.

    Example:
        >>> plan = plan_dim0_shards([ParamSpec(name="w", shape=(3, 2))], [0], shard_size=2)
        >>> [(s.rank, s.start, s.stop) for s in plan.shards]
        [(0, 0, 4), (1, 4, 6)]
    """
    if len(groups) != len(specs):
        raise ValueError(f"{len(groups)} param-group indices for {len(specs)} parameters")
    cut = plan_param_shards(specs, world_size=shard_size)
    shards = []
    for spec, group in zip(specs, groups, strict=True):
        if not spec.requires_grad:
            continue
        for rank in range(shard_size):
            start, stop = cut.chunk(spec.name, rank).element_range
            if stop > start:
                shards.append(Shard(name=spec.name, rank=rank, start=start, stop=stop, group=group))
    return ShardPlan(kind=DIM0, world_size=shard_size, shards=tuple(shards))
