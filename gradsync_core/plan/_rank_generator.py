"""One rank generator: Megatron-core's order-string group arithmetic (docs/design.md §5).

Megatron-core builds its groups from two ``RankGenerator`` objects over the same world, a dense
one (ep = 1) and an expert one (cp = 1); ``Topology`` holds one of each. This module is the
arithmetic of a single generator, written from the rule rather than from Megatron's code: the
first token of ``order`` varies fastest, so rank = rank_offset + sum(coord[t] * stride[t]) with
``stride[t]`` the product of the sizes of the tokens before ``t``. Hybrid sharding (HSDP) splits
the data-parallel axis in two, as torchtitan's ``ParallelDims`` does: ``dp_shard`` consecutive
members (the faster part) and ``dp_replicate`` groups of them (``dp = dp_shard * dp_replicate``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GENERATOR_AXES = ("tp", "cp", "ep", "dp", "pp")
# The two parts of dp under hybrid sharding (torchtitan's names), the shard part faster.
HSDP_AXES = ("dp_shard", "dp_replicate")


def _offsets(sizes: list[int], strides: list[int]) -> list[int]:
    """Every sum of coord*stride, the first axis varying fastest."""
    offsets = [0]
    for size, stride in zip(sizes, strides, strict=True):
        offsets = [base + i * stride for i in range(size) for base in offsets]
    return offsets


def _offset_at(index: int, sizes: list[int], strides: list[int]) -> int:
    """``_offsets(sizes, strides)[index]`` without building the list: decompose ``index``
    into coordinates, the first axis fastest, so one entry of a 10^6-rank world costs
    O(axes) instead of O(world_size)."""
    offset = 0
    for size, stride in zip(sizes, strides, strict=True):
        index, coord = divmod(index, size)
        offset += coord * stride
    return offset


def _is_index(value: object, length: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < length


def parse_generator_name(name: str) -> tuple[str, ...]:
    """The axes of a group name such as ``"dp-cp"``: distinct tokens of ``GENERATOR_AXES``."""
    axes = tuple(name.split("-")) if isinstance(name, str) else ()
    if not axes or len(set(axes)) != len(axes) or any(a not in GENERATOR_AXES for a in axes):
        raise ValueError(
            f"group name {name!r} must join distinct axes from {GENERATOR_AXES} with '-', "
            "e.g. 'dp-cp'"
        )
    return axes


def complete_order(order: str) -> str:
    """``order`` with the axes it leaves out added, keeping whether it ends in ``pp``.

    The added axes have size 1, so where they go changes no group; they go before a final
    ``pp`` because Megatron-core's ``initialize_model_parallel`` applies its pp-last rule to
    the order string as typed (``order.endswith("pp")``): "tp-cp-dp-pp" must stay pp-last once
    completed, or a completed order read back from JSON would be refused where the typed one
    was accepted.

    Example:
        >>> complete_order("tp-cp-dp-pp"), complete_order("tp-dp")
        ('tp-cp-dp-ep-pp', 'tp-dp-cp-ep-pp')
    """
    tokens = order.split("-")
    missing = [a for a in GENERATOR_AXES if a not in tokens]
    if tokens[-1] == "pp":
        return "-".join(tokens[:-1] + missing + ["pp"])
    return "-".join(tokens + missing)


@dataclass(frozen=True, slots=True, kw_only=True)
class RankGenerator:
    """Groups of one Megatron-core rank generator: sizes, an order string and a rank offset.

    Megatron-core refuses ``ep > 1`` together with ``cp > 1`` in one generator (context
    parallelism lives in the dense generator, expert parallelism in the expert one), and so does
    this class. Axes of size 1 may be left out of ``order``; they are added in
    ``GENERATOR_AXES`` order, before a final ``pp`` when the order ends in one (so the order
    still ends in ``pp``: Megatron-core's pp-last rule reads the order as the user typed it,
    see ``complete_order``), else at the end.

    ``dp_shard`` (not Megatron-core's; torchtitan's HSDP split) cuts ``dp`` into the axes
    ``"dp_shard"`` (``dp_shard`` consecutive data-parallel members, the faster) and
    ``"dp_replicate"`` (``dp // dp_shard``), two more group names; ``"dp"`` stays their union.
    ``None`` (the default) leaves ``dp`` whole.

    Example:
        >>> gen = RankGenerator(tp=2, ep=2, dp=2, order="tp-cp-ep-dp-pp")
        >>> gen.groups("ep"), gen.groups("dp")[:2]
        (((0, 2), (1, 3), (4, 6), (5, 7)), ((0, 4), (1, 5)))
        >>> hsdp = RankGenerator(dp=4, dp_shard=2)
        >>> hsdp.groups("dp_shard"), hsdp.groups("dp_replicate")
        (((0, 1), (2, 3)), ((0, 2), (1, 3)))
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    rank_offset: int = 0
    dp_shard: int | None = None  # None: dp is not split (no hybrid sharding)

    def __post_init__(self) -> None:
        for axis in GENERATOR_AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a positive int, got {size!r}")
        offset = self.rank_offset
        if not isinstance(offset, int) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"rank_offset must be a non-negative int, got {offset!r}")
        if self.ep > 1 and self.cp > 1:
            raise ValueError(
                f"ep = {self.ep} and cp = {self.cp} are both > 1 in one rank generator; as in "
                "Megatron-core, cp belongs to the dense generator and ep to the expert one "
                "(Topology builds both)"
            )
        shard = self.dp_shard
        if shard is not None and (
            not isinstance(shard, int) or isinstance(shard, bool) or shard < 1 or self.dp % shard
        ):
            raise ValueError(
                f"dp_shard = {shard!r} must be a positive divisor of dp = {self.dp}: hybrid "
                "sharding cuts each data-parallel group into shard groups of dp_shard "
                "consecutive members; choose a divisor (e.g. the ranks of one node)"
            )
        tokens = self.order.split("-") if isinstance(self.order, str) else [None]
        if len(set(tokens)) != len(tokens) or any(t not in GENERATOR_AXES for t in tokens):
            raise ValueError(
                f"order {self.order!r} must join distinct axes from {GENERATOR_AXES} with '-'"
            )
        bad = [a for a in GENERATOR_AXES if a not in tokens and getattr(self, a) > 1]
        if bad:
            raise ValueError(
                f"order {self.order!r} leaves out {bad}, whose size is > 1; name every axis "
                "of size > 1 in the order (Megatron-core refuses it too)"
            )
        object.__setattr__(self, "order", complete_order(self.order))

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, a) for a in GENERATOR_AXES)

    def _axes(self) -> tuple[tuple[str, int, int], ...]:
        """``(axis, size, stride)`` of every axis in order, the first fastest; with
        ``dp_shard`` set, ``dp`` is two axes: ``dp_shard`` then ``dp_replicate``."""
        axes, stride = [], 1
        for token in self.tokens:
            size = getattr(self, token)
            if token == "dp" and self.dp_shard is not None:
                axes.append(("dp_shard", self.dp_shard, stride))
                axes.append(("dp_replicate", size // self.dp_shard, stride * self.dp_shard))
            else:
                axes.append((token, size, stride))
            stride *= size
        return tuple(axes)

    @property
    def sizes(self) -> dict[str, int]:
        """Axis -> size in order, the first fastest (``dp`` split in two under ``dp_shard``)."""
        return {axis: size for axis, size, _ in self._axes()}

    def _members(self, name: str) -> set[str]:
        """The axes of group ``name`` as ``_axes`` names them (``"dp"`` is both halves of a
        split dp)."""
        if self.dp_shard is None:
            return set(parse_generator_name(name))
        axes = tuple(name.split("-")) if isinstance(name, str) else ()
        known = GENERATOR_AXES + HSDP_AXES
        if not axes or len(set(axes)) != len(axes) or any(a not in known for a in axes):
            raise ValueError(
                f"group name {name!r} must join distinct axes from {known} with '-', "
                "e.g. 'dp_shard-cp'"
            )
        if "dp" in axes and set(HSDP_AXES) & set(axes):
            raise ValueError(
                f"group name {name!r} names dp and a part of it; 'dp' is already "
                "'dp_shard-dp_replicate': name one or the other"
            )
        members = set(axes) - {"dp"}
        return members | set(HSDP_AXES) if "dp" in axes else members

    def group_size(self, name: str) -> int:
        members = self._members(name)
        return math.prod(size for axis, size, _ in self._axes() if axis in members)

    def strides(self) -> dict[str, int]:
        strides, running = {}, 1
        for token in self.tokens:
            strides[token] = running
            running *= getattr(self, token)
        return strides

    def check_rank(self, rank: int) -> None:
        inside = isinstance(rank, int) and _is_index(rank - self.rank_offset, self.world_size)
        if not inside:
            first, last = self.rank_offset, self.rank_offset + self.world_size - 1
            raise ValueError(
                f"rank {rank!r} is outside a world of {self.world_size} (ranks {first}..{last})"
            )

    def _coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis of ``_axes``."""
        self.check_rank(rank)
        local = rank - self.rank_offset
        return {axis: (local // stride) % size for axis, size, stride in self._axes()}

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis (with ``dp_shard``, on its two parts too)."""
        self.check_rank(rank)
        local, strides = rank - self.rank_offset, self.strides()
        coords = {t: (local // strides[t]) % getattr(self, t) for t in self.tokens}
        if self.dp_shard is not None:
            fine = self._coordinates(rank)
            coords |= {axis: fine[axis] for axis in HSDP_AXES}
        return coords

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes: 0); with ``dp_shard``, the
        ``dp_shard`` and ``dp_replicate`` coordinates may replace ``dp`` (or, as
        ``coordinates`` gives them, agree with it)."""
        halves = {axis: coords.pop(axis) for axis in HSDP_AXES if axis in coords}
        if halves:
            if self.dp_shard is None:
                raise ValueError(
                    f"coordinates {sorted(halves)} name the parts of a split dp, but this "
                    "generator has no dp_shard; give the dp coordinate"
                )
            sizes = self.sizes
            for axis, c in halves.items():
                if not _is_index(c, sizes[axis]):
                    raise ValueError(f"coordinate {axis}={c!r} is outside this topology")
            dp = halves.get("dp_shard", 0) + self.dp_shard * halves.get("dp_replicate", 0)
            if coords.setdefault("dp", dp) != dp:
                raise ValueError(
                    f"coordinate dp={coords['dp']!r} does not match dp_shard and "
                    f"dp_replicate {halves} (dp = dp_shard + {self.dp_shard} * dp_replicate)"
                )
        strides = self.strides()
        for axis, c in coords.items():
            if axis not in strides or not _is_index(c, getattr(self, axis)):
                raise ValueError(f"coordinate {axis}={c!r} is outside this topology")
        return self.rank_offset + sum(c * strides[a] for a, c in coords.items())

    def _split(self, name: str) -> tuple[list[int], list[int], list[int], list[int]]:
        """Sizes and strides of the member axes and of the other axes, in ``order``."""
        members = self._members(name)
        axes = self._axes()
        inner = [(size, stride) for axis, size, stride in axes if axis in members]
        outer = [(size, stride) for axis, size, stride in axes if axis not in members]
        return (
            [size for size, _ in inner],
            [stride for _, stride in inner],
            [size for size, _ in outer],
            [stride for _, stride in outer],
        )

    def groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """Every group that varies the axes in ``name`` and fixes the rest (Megatron's
        ``get_ranks``): ranks ascend, groups listed with the first non-member axis fastest."""
        inner_sizes, inner_strides, outer_sizes, outer_strides = self._split(name)
        within = _offsets(inner_sizes, inner_strides)
        bases = _offsets(outer_sizes, outer_strides)
        return tuple(tuple(self.rank_offset + base + o for o in within) for base in bases)

    def group_count(self, name: str) -> int:
        return self.world_size // self.group_size(name)

    def rank_at(self, name: str, index: int, group_rank: int) -> int:
        """The rank at place ``group_rank`` of ``groups(name)[index]``, by arithmetic."""
        inner_sizes, inner_strides, outer_sizes, outer_strides = self._split(name)
        count, size = math.prod(outer_sizes), math.prod(inner_sizes)
        if not _is_index(index, count) or not _is_index(group_rank, size):
            raise ValueError(
                f"group {index!r}, place {group_rank!r} is outside the {count} {name!r} "
                f"groups of {size} ranks each"
            )
        base = _offset_at(index, outer_sizes, outer_strides)
        return self.rank_offset + base + _offset_at(group_rank, inner_sizes, inner_strides)

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of ``name`` that contains ``rank``."""
        members, coords = self._members(name), self._coordinates(rank)
        base = rank - sum(coords[a] * stride for a, _, stride in self._axes() if a in members)
        inner_sizes, inner_strides, _, _ = self._split(name)
        return tuple(base + o for o in _offsets(inner_sizes, inner_strides))

    def group_rank(self, name: str, rank: int) -> int:
        """Position of ``rank`` inside its ``name`` group: the member coordinates, first
        member axis fastest (what ``.index()`` on the ascending group would find)."""
        members, coords, place, scale = self._members(name), self._coordinates(rank), 0, 1
        for axis, size, _ in self._axes():
            if axis in members:
                place += coords[axis] * scale
                scale *= size
        return place
