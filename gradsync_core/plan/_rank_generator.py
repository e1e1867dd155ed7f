"""One rank generator: Megatron-core's order-string group arithmetic (docs/design.md §5).

Megatron-core builds its groups from two ``RankGenerator`` objects over the same world, a dense
one (ep = 1) and an expert one (cp = 1); ``Topology`` holds one of each. This module is the
arithmetic of a single generator, written from the rule rather than from Megatron's code: the
first token of ``order`` varies fastest, so rank = rank_offset + sum(coord[t] * stride[t]) with
``stride[t]`` the product of the sizes of the tokens before ``t``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GENERATOR_AXES = ("tp", "cp", "ep", "dp", "pp")


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

    Example:
        >>> gen = RankGenerator(tp=2, ep=2, dp=2, order="tp-cp-ep-dp-pp")
        >>> gen.groups("ep"), gen.groups("dp")[:2]
        (((0, 2), (1, 3), (4, 6), (5, 7)), ((0, 4), (1, 5)))
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: str = "tp-cp-ep-dp-pp"
    rank_offset: int = 0

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

    def group_size(self, name: str) -> int:
        return math.prod(getattr(self, a) for a in parse_generator_name(name))

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

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis."""
        self.check_rank(rank)
        local, strides = rank - self.rank_offset, self.strides()
        return {t: (local // strides[t]) % getattr(self, t) for t in self.tokens}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes: 0)."""
        strides = self.strides()
        for axis, c in coords.items():
            if axis not in strides or not _is_index(c, getattr(self, axis)):
                raise ValueError(f"coordinate {axis}={c!r} is outside this topology")
        return self.rank_offset + sum(c * strides[a] for a, c in coords.items())

    def _split(self, name: str) -> tuple[list[int], list[int], list[int], list[int]]:
        """Sizes and strides of the member axes and of the other axes, in ``order``."""
        members = set(parse_generator_name(name))
        strides = self.strides()
        inner = [t for t in self.tokens if t in members]
        outer = [t for t in self.tokens if t not in members]
        return (
            [getattr(self, t) for t in inner],
            [strides[t] for t in inner],
            [getattr(self, t) for t in outer],
            [strides[t] for t in outer],
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
        members = set(parse_generator_name(name))
        coords, strides = self.coordinates(rank), self.strides()
        base = rank - sum(coords[a] * strides[a] for a in members)
        inner_sizes, inner_strides, _, _ = self._split(name)
        return tuple(base + o for o in _offsets(inner_sizes, inner_strides))

    def group_rank(self, name: str, rank: int) -> int:
        """Position of ``rank`` inside its ``name`` group: the member coordinates, first
        member axis fastest (what ``.index()`` on the ascending group would find)."""
        coords, place, scale = self.coordinates(rank), 0, 1
        members = set(parse_generator_name(name))
        for token in self.tokens:
            if token in members:
                place += coords[token] * scale
                scale *= getattr(self, token)
        return place
