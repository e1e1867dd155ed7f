"""Parallel-group topology with Megatron-core's order-string semantics (docs/design.md §5)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gradsync_core._canonical import PLAN_VERSION, check_header, fingerprint

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# The groups a Megatron-style job creates: each axis alone, the model-parallel pair, the
# tensor+context group (sequence-sharded norms), and data+context (gradient reduction).
STANDARD_GROUPS = ("tp", "cp", "ep", "dp", "pp", "tp-cp", "dp-cp", "tp-pp", "tp-dp-cp")


def _parse_axes(name: str) -> tuple[str, ...]:
    axes = tuple(name.split("-"))
    unknown = [a for a in axes if a not in AXES]
    if unknown or len(set(axes)) != len(axes) or not name:
        raise ValueError(
            f"group name {name!r} must join distinct axes from {AXES} with '-', e.g. 'dp-cp'"
        )
    return axes


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Sizes of the parallel axes and the order in which ranks enumerate them.

    The first token of ``order`` varies fastest: rank = sum(coord[t] * stride[t]), where
    ``stride[t]`` is the product of the sizes of the tokens before ``t``. Groups are identical
    to Megatron-core's ``generate_masked_orthogonal_rank_groups``.

    Example:
        >>> topo = Topology.create(world_size=8, tp=2, cp=2)
        >>> topo.dp, topo.groups("tp-cp")
        (2, ((0, 1, 2, 3), (4, 5, 6, 7)))
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{axis} must be a positive int, got {size!r}")
        tokens = self.order.split("-")
        if len(set(tokens)) != len(tokens) or any(t not in AXES for t in tokens):
            raise ValueError(f"order {self.order!r} must join distinct axes from {AXES} with '-'")
        missing = [a for a in AXES if a not in tokens]
        if any(getattr(self, a) > 1 for a in missing):
            bad = [a for a in missing if getattr(self, a) > 1]
            raise ValueError(f"order {self.order!r} leaves out {bad}, whose size is > 1")
        # Axes of size 1 may be left out of the order; they go last, as in Megatron-core.
        object.__setattr__(self, "order", "-".join(tokens + missing))

    @classmethod
    def create(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        pp: int = 1,
        dp: int = -1,
        order: str = DEFAULT_ORDER,
    ) -> Topology:
        """A topology for ``world_size`` ranks; ``dp=-1`` infers dp from the others.

        Raises:
            ValueError: if the sizes do not multiply to ``world_size``.
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        model = tp * cp * ep * pp
        if dp == -1:
            if model < 1 or world_size % model:
                raise ValueError(
                    f"tp*cp*ep*pp = {tp}*{cp}*{ep}*{pp} = {model} does not divide "
                    f"world_size = {world_size}; choose sizes whose product divides it"
                )
            dp = world_size // model
        if model * dp != world_size:
            raise ValueError(
                f"tp*cp*ep*dp*pp = {tp}*{cp}*{ep}*{dp}*{pp} = {model * dp} but world_size = "
                f"{world_size}; pass dp=-1 to infer dp"
            )
        return cls(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=order)

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, a) for a in AXES)

    def group_size(self, name: str) -> int:
        return math.prod(getattr(self, a) for a in _parse_axes(name))

    def _strides(self) -> dict[str, int]:
        strides, running = {}, 1
        for token in self.tokens:
            strides[token] = running
            running *= getattr(self, token)
        return strides

    def coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on every axis."""
        self._check_rank(rank)
        strides = self._strides()
        return {t: (rank // strides[t]) % getattr(self, t) for t in self.tokens}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given coordinates (missing axes: 0)."""
        strides = self._strides()
        for axis, c in coords.items():
            if axis not in strides or not 0 <= c < getattr(self, axis):
                raise ValueError(f"coordinate {axis}={c!r} is outside this topology")
        return sum(c * strides[a] for a, c in coords.items())

    def _split(self, name: str) -> tuple[list[int], list[int], list[int], list[int]]:
        """Sizes and strides of the member axes and of the other axes, in ``order``."""
        members = set(_parse_axes(name))
        strides = self._strides()
        inner = [t for t in self.tokens if t in members]
        outer = [t for t in self.tokens if t not in members]
        return (
            [getattr(self, t) for t in inner],
            [strides[t] for t in inner],
            [getattr(self, t) for t in outer],
            [strides[t] for t in outer],
        )

    def groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """Every group that varies the axes in ``name`` and fixes the rest.

        Ranks inside a group ascend; groups are listed with the first non-member axis (in
        ``order``) varying fastest — Megatron-core's order. This lists all ``world_size``
        ranks; for a large world ask for one group with ``group_at`` or ``group_of``.
        """
        inner_sizes, inner_strides, outer_sizes, outer_strides = self._split(name)
        within = _offsets(inner_sizes, inner_strides)
        bases = _offsets(outer_sizes, outer_strides)
        return tuple(tuple(base + o for o in within) for base in bases)

    def group_count(self, name: str) -> int:
        """How many ``name`` groups partition the world: ``world_size // group_size(name)``."""
        return self.world_size // self.group_size(name)

    def rank_at(self, name: str, index: int, group_rank: int) -> int:
        """The rank at place ``group_rank`` of ``groups(name)[index]``, by arithmetic.

        Example:
            >>> Topology.create(world_size=8, tp=2, cp=2).rank_at("dp-cp", 1, 2)
            5
        """
        inner_sizes, inner_strides, outer_sizes, outer_strides = self._split(name)
        count, size = math.prod(outer_sizes), math.prod(inner_sizes)
        if not _is_index(index, count) or not _is_index(group_rank, size):
            raise ValueError(
                f"group {index!r}, place {group_rank!r} is outside the {count} {name!r} "
                f"groups of {size} ranks each"
            )
        base = _offset_at(index, outer_sizes, outer_strides)
        return base + _offset_at(group_rank, inner_sizes, inner_strides)

    def group_at(self, name: str, index: int) -> tuple[int, ...]:
        """``groups(name)[index]`` without listing the other groups."""
        return tuple(self.rank_at(name, index, place) for place in range(self.group_size(name)))

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of ``name`` that contains ``rank``."""
        members = set(_parse_axes(name))
        coords, strides = self.coordinates(rank), self._strides()
        base = rank - sum(coords[a] * strides[a] for a in members)
        inner_sizes, inner_strides, _, _ = self._split(name)
        return tuple(base + o for o in _offsets(inner_sizes, inner_strides))

    def group_rank(self, name: str, rank: int) -> int:
        """Position of ``rank`` inside its ``name`` group (torch's group-local rank)."""
        # The member coordinates, first member axis fastest: what .index() on the
        # ascending group would find, without listing the group.
        coords, place, scale = self.coordinates(rank), 0, 1
        members = set(_parse_axes(name))
        for token in self.tokens:
            if token in members:
                place += coords[token] * scale
                scale *= getattr(self, token)
        return place

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of ``arange(world_size).reshape(shape)``, whose fibres are the groups."""
        return tuple(getattr(self, t) for t in reversed(self.tokens))

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        return tuple(reversed(self.tokens))

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axis names of group ``name``, in mesh order (``"dp-cp"`` -> ("dp", "cp"))."""
        members = set(_parse_axes(name))
        return tuple(a for a in self.mesh_axis_names if a in members)

    def _check_rank(self, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank!r} is outside a world of {self.world_size}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": "topology", "version": PLAN_VERSION, "order": self.order} | {
            axis: getattr(self, axis) for axis in AXES
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Topology:
        check_header(obj, "topology")
        return cls(order=obj["order"], **{axis: obj[axis] for axis in AXES})

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def _is_index(value: object, length: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < length


def split_shapes(size: int, parts: int) -> tuple[int, ...]:
    """Chunk sizes for splitting a dimension of ``size`` over ``parts`` ranks.

    Chunks of ``ceil(size/parts)`` with a smaller last one; if that would leave the last
    chunk empty or negative, chunks of ``floor(size/parts)`` with a larger last one.

    Example:
        >>> split_shapes(10, 4), split_shapes(9, 4), split_shapes(5, 4)
        ((3, 3, 3, 1), (2, 2, 2, 3), (1, 1, 1, 2))

    Raises:
        ValueError: if ``size < parts`` (some rank would get nothing).
    """
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    if not isinstance(size, int) or size < parts:
        raise ValueError(
            f"cannot split a dimension of {size} over {parts} ranks: each needs at least one"
        )
    chunk = -(-size // parts)
    last = size - chunk * (parts - 1)
    if last <= 0:
        chunk = size // parts
        last = size - chunk * (parts - 1)
    return (chunk,) * (parts - 1) + (last,)
