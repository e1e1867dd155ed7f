"""Parameter-shard plans (ZeRO-3): every parameter cut along dim 0 as FSDP2 cuts it.

Parameters are grouped into units gathered together (ZeRO-3, arXiv:1910.02054 §5;
docs/design.md §16).

One plan serves both executors: torch's ``fully_shard`` and JAX's ``shard_map`` read the same
units, the same dim-0 chunks and the same padding, so their fingerprints can be compared.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync_core.deprecation import deprecated_keywords, warn_deprecated
from gradsync_core.plan._buckets import check_positive
from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._param_units import assign_units
from gradsync_core.plan._specs import ParamSpec, check_unique_names, itemsize


def chunk_rows(rows: int, shard_size: int, shard_rank: int) -> tuple[int, int, int]:
    """``(start, stop, padded_rows)`` of dim-0 rows that ``shard_rank`` holds, as ``torch.chunk``.

    ``torch.chunk(t, n)`` cuts chunks of ``c = ceil(rows / n)`` rows and may return fewer than
    ``n`` of them; FSDP2 (``_chunk_with_empty``) gives the missing ranks empty chunks and pads
    every rank to chunk 0's ``c`` rows. So rank ``r`` holds rows
    ``[min(r*c, rows), min((r+1)*c, rows))`` and stores ``c`` rows, the rest zero padding.

    Example:
        >>> [chunk_rows(5, 4, r) for r in range(4)]
        [(0, 2, 2), (2, 4, 2), (4, 5, 2), (5, 5, 2)]
    """
    padded = -(-rows // shard_size)
    return min(shard_rank * padded, rows), min((shard_rank + 1) * padded, rows), padded


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamChunk:
    """Rows ``[start, stop)`` of dim 0 of parameter ``name`` held by shard rank ``shard_rank``.

    Every rank stores ``padded_shape`` (``padded_rows`` rows); the rows past ``stop - start``
    are zero padding, so all-gathers and reduce-scatters move equal pieces.
    """

    name: str
    shard_rank: int
    start: int
    stop: int
    padded_rows: int
    shape: tuple[int, ...]  # the whole parameter's shape

    @property
    def row_numel(self) -> int:
        return math.prod(self.shape[1:])

    @property
    def local_shape(self) -> tuple[int, ...]:
        """The unpadded local shape: FSDP2's ``DTensor.to_local().shape``."""
        return (self.stop - self.start, *self.shape[1:])

    @property
    def padded_shape(self) -> tuple[int, ...]:
        return (self.padded_rows, *self.shape[1:])

    @property
    def numel(self) -> int:
        return (self.stop - self.start) * self.row_numel

    @property
    def padded_numel(self) -> int:
        return self.padded_rows * self.row_numel

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.numel

    @property
    def element_range(self) -> tuple[int, int]:
        """``[start, stop)`` in elements of the flattened parameter (a checkpoint's slice)."""
        return self.start * self.row_numel, self.stop * self.row_numel


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardedParam:
    """One parameter of a plan, trainable or frozen, with the unit that gathers it."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # the stored (sharded) dtype; mixed precision casts after the gather
    requires_grad: bool
    unit: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Unit:
    """Parameters gathered together: one ``fully_shard`` call.

    ``prefix`` is the module path (``"layers.0"``; ``""`` for the root). ``params`` lists the
    members in FSDP2's gather order (its module walk, children before their parent).
    """

    index: int
    prefix: str
    params: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamShardPlan:
    """Which rows of which parameter each rank holds, and which parameters are gathered together.

    ``world_size = shard_size * replicate_size``: parameters are cut over a shard group of
    ``shard_size`` ranks and replicated over ``replicate_size`` such groups (HSDP; plain FSDP
    has ``replicate_size == 1``). Chunks are indexed by the rank inside the shard group; which
    global ranks form a group is the executor's mesh. ``params`` keeps the specs' order; units
    run root first, then in module order.
    """

    shard_size: int
    replicate_size: int
    params: tuple[ShardedParam, ...]
    units: tuple[Unit, ...]
    _by_name: dict[str, ShardedParam] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_positive(shard_size=self.shard_size, replicate_size=self.replicate_size)
        by_name = {p.name: p for p in self.params}
        for p in self.params:
            ParamSpec(name=p.name, shape=p.shape, dtype=p.dtype)  # names, dims and dtype
            if not p.shape:
                raise ValueError(f"parameter {p.name!r} is 0-d; a parameter-shard plan cuts dim 0")
        if len(by_name) != len(self.params):
            check_unique_names(ParamSpec(name=p.name, shape=(1,)) for p in self.params)
        members = Counter(name for unit in self.units for name in unit.params)
        for name in {**by_name, **members}:
            if name not in by_name:
                raise ValueError(
                    f"a unit lists {name!r}, which is not a parameter of the plan; "
                    "every unit member must be one of the plan's parameters"
                )
            if members[name] != 1:
                raise ValueError(
                    f"parameter {name!r} is a member of {members[name]} units; "
                    "every parameter must be a member of exactly one unit"
                )
        for index, unit in enumerate(self.units):
            if unit.index != index or any(by_name[n].unit != index for n in unit.params):
                raise ValueError(f"unit {unit.prefix!r} does not match its parameters' units")
        object.__setattr__(self, "_by_name", by_name)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    def param(self, name: str) -> ShardedParam:
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"parameter {name!r} is not in this plan") from None

    def unit_of(self, name: str) -> Unit:
        """The unit that gathers parameter ``name``."""
        return self.units[self.param(name).unit]

    def chunk(self, name: str, shard_rank: int) -> ParamChunk:
        """Parameter ``name``'s dim-0 chunk on shard rank ``shard_rank``."""
        if not 0 <= shard_rank < self.shard_size:
            raise ValueError(f"shard_rank must be in [0, {self.shard_size}), got {shard_rank}")
        p = self.param(name)
        start, stop, padded = chunk_rows(p.shape[0], self.shard_size, shard_rank)
        return ParamChunk(
            name=name,
            shard_rank=shard_rank,
            start=start,
            stop=stop,
            padded_rows=padded,
            shape=p.shape,
        )

    def chunks_of(self, shard_rank: int) -> tuple[ParamChunk, ...]:
        """Every parameter's chunk on ``shard_rank``, in ``params`` order."""
        return tuple(self.chunk(p.name, shard_rank) for p in self.params)

    def unit_padded_numel(self, unit: int, *, trainable_only: bool = False) -> int:
        """Elements one rank stores for ``unit`` (padding included); ``shard_size`` times this
        is the gathered unit, as FSDP2's all-gather output holds it."""
        return sum(
            self.chunk(name, 0).padded_numel
            for name in self.units[unit].params
            if self._by_name[name].requires_grad or not trainable_only
        )

    def unit_padded_nbytes(self, unit: int, *, trainable_only: bool = False) -> int:
        """Bytes one rank stores for ``unit`` in the stored dtypes, padding included."""
        return sum(
            self.chunk(name, 0).padded_numel * itemsize(self._by_name[name].dtype)
            for name in self.units[unit].params
            if self._by_name[name].requires_grad or not trainable_only
        )

    def renamed(
        self, names: Mapping[str, str], prefixes: Mapping[str, str] | None = None
    ) -> ParamShardPlan:
        """The same plan with parameters (and, if given, unit prefixes) renamed.

        Executors plan under one naming (torch's module paths) and run under their own (a Flax
        key path): the chunks and units do not change, only the labels.

        Raises:
            ValueError: if ``names`` misses a parameter or maps two to one name.
        """
        missing = [p.name for p in self.params if p.name not in names]
        if missing:
            raise ValueError(
                f"renamed() needs a new name for every parameter; missing {missing[:3]}"
            )
        prefixes = prefixes or {}
        params = tuple(_replace_param(p, name=names[p.name]) for p in self.params)
        units = tuple(
            Unit(
                index=u.index,
                prefix=prefixes.get(u.prefix, u.prefix),
                params=tuple(names[n] for n in u.params),
            )
            for u in self.units
        )
        if len({p.name for p in params}) != len(params):
            raise ValueError("renamed() maps two parameters to one name; names must stay unique")
        return ParamShardPlan(
            shard_size=self.shard_size,
            replicate_size=self.replicate_size,
            params=params,
            units=units,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "param_shard_plan",
            "version": PLAN_VERSION,
            "rule": "dim0_torch_chunk",  # what the chunks are: chunk_rows, FSDP2's cut
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "params": [
                {
                    "name": p.name,
                    "shape": list(p.shape),
                    "dtype": p.dtype,
                    "requires_grad": p.requires_grad,
                    "unit": p.unit,
                }
                for p in self.params
            ],
            "units": [{"prefix": u.prefix, "params": list(u.params)} for u in self.units],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ParamShardPlan:
        """Read ``to_json()``'s output back; the plan's own checks run again.

        Raises:
            ValueError: another kind, version or rule, or members that do not add up.
        """
        check_header(obj, "param_shard_plan")
        if obj.get("rule") != "dim0_torch_chunk":
            raise ValueError(
                f"param_shard_plan has rule {obj.get('rule')!r}; this gradsync cuts with "
                "'dim0_torch_chunk': re-create the plan with this version"
            )
        return cls(
            shard_size=obj["shard_size"],
            replicate_size=obj["replicate_size"],
            params=tuple(
                ShardedParam(
                    name=p["name"],
                    shape=tuple(p["shape"]),
                    dtype=p["dtype"],
                    requires_grad=p["requires_grad"],
                    unit=p["unit"],
                )
                for p in obj["params"]
            ),
            units=tuple(
                Unit(index=i, prefix=u["prefix"], params=tuple(u["params"]))
                for i, u in enumerate(obj["units"])
            ),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def _replace_param(p: ShardedParam, *, name: str) -> ShardedParam:
    return ShardedParam(
        name=name, shape=p.shape, dtype=p.dtype, requires_grad=p.requires_grad, unit=p.unit
    )


@deprecated_keywords(replicate_size="dp_shard=world_size // replicate_size")
def plan_param_shards(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    units: Iterable[str] = (),
    dp_shard: int | None = None,
    replicate_size: int | None = None,
) -> ParamShardPlan:
    """Cut every parameter along dim 0 exactly as FSDP2's ``fully_shard`` does.

    Each prefix in ``units`` is a block the user wraps (``fully_shard(model.layers[0])``); the
    root ``""`` is always a unit and holds every parameter no block claims. Blocks may nest, as
    ``fully_shard`` calls may (applied bottom-up): a parameter belongs to its innermost block.
    Every parameter, trainable or frozen, is cut over the ``dp_shard`` ranks of a shard group
    (``Topology.dp_shard``) by ``chunk_rows`` (``torch.chunk``: ``ceil(d / n)`` rows per rank,
    the last ranks short or empty, everyone padded to full). A tied parameter belongs to the
    unit of the name it is listed under (its first name in ``named_parameters()``).

    Args:
        specs: every parameter once, in ``named_parameters()`` order (module paths).
        world_size: data-parallel ranks (``Topology.dp``; HSDP: shard group x replicas).
        units: module prefixes of the blocks, e.g. ``["layers.0", "layers.1"]``.
        dp_shard: hybrid sharding (HSDP): the ranks of a shard group, a divisor of
            ``world_size``; the plan replicates over ``world_size // dp_shard`` such groups.
            Default ``world_size`` (plain FSDP).
        replicate_size: the deprecated spelling: ``world_size // dp_shard``.

    Raises:
        ValueError: a 0-d parameter (FSDP2 refuses scalars), a prefix that names no module or
            is listed twice, or a ``dp_shard`` (``replicate_size``) that does not divide
            ``world_size``.

    Example:
        >>> specs = [ParamSpec(name="emb.weight", shape=(5, 2)),
        ...          ParamSpec(name="layers.0.weight", shape=(3, 2))]
        >>> plan = plan_param_shards(specs, world_size=4, units=["layers.0"])
        >>> [(u.prefix, u.params) for u in plan.units]
        [('', ('emb.weight',)), ('layers.0', ('layers.0.weight',))]
        >>> last = plan.chunk("layers.0.weight", 3)  # 3 rows over 4 ranks: rank 3 holds none
        >>> last.local_shape, last.padded_shape
        ((0, 2), (1, 2))
    """
    check_positive(world_size=world_size)
    if replicate_size is not None:  # the deprecated spelling counts the replicas
        if dp_shard is not None:
            raise TypeError(
                "plan_param_shards() got dp_shard= and its deprecated spelling "
                "replicate_size=; pass dp_shard="
            )
        warn_deprecated(
            "plan_param_shards(replicate_size=)",
            "plan_param_shards(dp_shard=world_size // replicate_size)",
        )
        check_positive(replicate_size=replicate_size)
        if world_size % replicate_size:
            raise ValueError(
                f"replicate_size {replicate_size} does not divide world_size {world_size}; "
                "HSDP needs world_size = shard_size * replicate_size"
            )
        dp_shard = world_size // replicate_size
    dp_shard = world_size if dp_shard is None else dp_shard
    check_positive(dp_shard=dp_shard)
    if world_size % dp_shard:
        raise ValueError(
            f"dp_shard {dp_shard} does not divide world_size {world_size}; HSDP cuts the "
            "world_size data-parallel ranks into shard groups of dp_shard: pick a divisor"
        )
    specs = list(specs)
    check_unique_names(specs)
    for spec in specs:
        if not spec.shape:
            raise ValueError(
                f"parameter {spec.name!r} is a scalar (0-d), which FSDP2 refuses to shard; "
                "make it a 1-d tensor of one element"
            )
    prefixes, members = assign_units(specs, units)
    index = {prefix: i for i, prefix in enumerate(prefixes)}
    unit_of = {name: index[prefix] for prefix in prefixes for name in members[prefix]}
    params = tuple(
        ShardedParam(
            name=s.name,
            shape=s.shape,
            dtype=s.dtype,
            requires_grad=s.requires_grad,
            unit=unit_of[s.name],
        )
        for s in specs
    )
    plan_units = tuple(
        Unit(index=index[prefix], prefix=prefix, params=tuple(members[prefix]))
        for prefix in prefixes
    )
    return ParamShardPlan(
        shard_size=dp_shard,
        replicate_size=world_size // dp_shard,
        params=params,
        units=plan_units,
    )
