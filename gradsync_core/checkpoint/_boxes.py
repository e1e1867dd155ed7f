"""Boxes: what each rank holds of a parameter under any layout, and who writes what of it.

See docs/checkpoints.md, "A checkpoint that crosses layouts".

Under tensor, expert, pipeline and sharded data parallelism at once, a rank holds a *box* of
each parameter it steps: a range along every dim of the whole (logical) tensor, e.g. the
``[rows of its dp_shard chunk] x [columns of its tp slice]`` of a row-parallel weight, or the
experts of its ``ep`` coordinate. Ranks that replicate a box (``dp_replicate``, ``cp``, ``tp``
for a parameter it does not split) hold the same one.

A gradsync checkpoint stores each parameter as flat element ranges of its row-major whole
tensor, one range per rank file (``ShardPlan`` of kind ``"dim0"``: rows ``[a, b)`` are
elements ``[a*row, b*row)``), and its weight whole in one file (``model_owners``), so the
loaders of every layout, one process and the other framework read it with no new code. A box
whose trailing dims are not whole (a column slice) is not one flat range; so the boxes that
share rows are a *block* (rows ``[a, b)`` x every column, one flat range) whose rows are cut
among the block's ranks, each writing its share after receiving it from the boxes that hold it
(``transfers``). Every element is written once: one replica of each box takes part.

Loading is the reverse without any exchange: a rank's new box is a few flat ranges
(``box_windows``: one when its trailing dims are whole, else one per row segment), read
through ``state_reads`` / ``weight_reads``, so a rank reads only the bytes of its box.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gradsync_core.checkpoint._param_shard_state import DIM0
from gradsync_core.checkpoint._reads import Window
from gradsync_core.plan._shards import Shard, ShardPlan
from gradsync_core.plan._specs import ParamSpec


@dataclass(frozen=True, slots=True, kw_only=True)
class Box:
    """Elements ``[start[d], stop[d])`` along each dim ``d`` of parameter ``name`` (of the
    whole tensor, in torch's layout) that rank ``rank`` holds; ``()`` for a 0-d one."""

    name: str
    rank: int
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def corner(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(start, stop)``: what replicas of one box share."""
        return self.start, self.stop


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfer:
    """The part ``[start, stop)`` (per dim, whole-tensor coordinates) of parameter ``name``
    that rank ``source`` (which holds it in its box) gives rank ``target``."""

    name: str
    source: int
    target: int
    start: tuple[int, ...]
    stop: tuple[int, ...]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop, strict=True))


def box_windows(box: Box, shape: Sequence[int]) -> tuple[Window, ...]:
    """The flat element ranges of ``box`` in the row-major tensor of ``shape``, in order.

    A box whose dims after its first split one are whole is one range; otherwise one range
    per row segment (the box's last split dim with every dim after it whole).

    Example:
        >>> [(w.start, w.stop) for w in box_windows(Box(name="w", rank=0, start=(1, 2),
        ...     stop=(3, 4)), (4, 4))]
        [(6, 8), (10, 12)]
    """
    shape = tuple(shape)
    _check_inside(box, shape)
    if box.numel == 0:
        return ()
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    # The last dim the box does not hold whole: everything after it is one run of elements.
    split = [d for d in range(len(shape)) if (box.start[d], box.stop[d]) != (0, shape[d])]
    last = split[-1] if split else -1
    runs: list[tuple[int, int]] = []
    outer = [range(box.start[d], box.stop[d]) for d in range(max(last, 0))]
    inner = strides[last] if last >= 0 else 1
    for index in _product(outer):
        base = sum(i * strides[d] for d, i in enumerate(index))
        lo = base + (box.start[last] * inner if last >= 0 else 0)
        hi = base + (box.stop[last] * inner if last >= 0 else math.prod(shape))
        if runs and runs[-1][1] == lo:  # consecutive rows of a box whole after its first dim
            runs[-1] = (runs[-1][0], hi)
        else:
            runs.append((lo, hi))
    return tuple(Window(name=box.name, start=a, stop=b) for a, b in runs)


def _product(ranges: Sequence[range]) -> Iterable[tuple[int, ...]]:
    if not ranges:
        yield ()
        return
    for i in ranges[0]:
        for rest in _product(ranges[1:]):
            yield (i, *rest)


def _check_inside(box: Box, shape: tuple[int, ...]) -> None:
    if len(box.start) != len(shape) or len(box.stop) != len(shape):
        raise ValueError(
            f"the box {box.start}..{box.stop} of {box.name!r} on rank {box.rank} has "
            f"{len(box.start)} dims but the parameter is {shape}; give one range per dim"
        )
    for a, b, n in zip(box.start, box.stop, shape, strict=True):
        if not 0 <= a <= b <= n:
            raise ValueError(
                f"the box {box.start}..{box.stop} of {box.name!r} on rank {box.rank} is not "
                f"inside the parameter's shape {shape}"
            )


def distinct_boxes(boxes: Iterable[Box], specs: Sequence[ParamSpec]) -> dict[str, list[Box]]:
    """Each parameter's boxes with replicas dropped (the lowest rank holding a box keeps it),
    in the order of their corners, checked to tile the parameter.

    Args:
        boxes: every rank's boxes (empty ones are ignored).
        specs: the whole parameters.

    Returns:
        ``{name: [box, ...]}`` for every parameter of ``specs``.

    Raises:
        ValueError: a box of a parameter ``specs`` lacks or outside its shape, or boxes
            that overlap without being equal or leave elements uncovered: the ranks do not
            hold one layout of this model.
    """
    shapes = {spec.name: tuple(spec.shape) for spec in specs}
    kept: dict[str, dict[tuple[tuple[int, ...], tuple[int, ...]], Box]] = {n: {} for n in shapes}
    for box in boxes:
        if box.name not in shapes:
            raise ValueError(
                f"rank {box.rank} holds a box of {box.name!r}, which the model does not have; "
                "describe the ranks' pieces with the whole model's names"
            )
        _check_inside(box, shapes[box.name])
        if box.numel == 0:
            continue
        seen = kept[box.name].get(box.corner)
        if seen is None or box.rank < seen.rank:
            kept[box.name][box.corner] = box
    out = {}
    for name, shape in shapes.items():
        found = sorted(kept[name].values(), key=lambda b: b.corner)
        _check_tiles(name, shape, found)
        out[name] = found
    return out


def _check_tiles(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    for i, a in enumerate(boxes):
        for b in boxes[i + 1 :]:
            if all(max(x0, y0) < min(x1, y1) for x0, x1, y0, y1 in _dims(a, b)):
                raise ValueError(
                    f"ranks {a.rank} and {b.rank} hold overlapping but different boxes of "
                    f"{name!r} ({a.start}..{a.stop} and {b.start}..{b.stop}); every replica "
                    "of a piece must hold the same box"
                )
    held = sum(box.numel for box in boxes)
    if held != math.prod(shape):
        raise ValueError(
            f"the ranks hold {held} of the {math.prod(shape)} elements of {name!r} {shape}; "
            "every element must be on some rank (save from every rank of the layout)"
        )


def _dims(a: Box, b: Box) -> Iterable[tuple[int, int, int, int]]:
    return zip(a.start, a.stop, b.start, b.stop, strict=True)


def plan_box_shards(
    specs: Sequence[ParamSpec],
    boxes: Mapping[str, Sequence[Box]],
    groups: Mapping[str, int],
    *,
    world_size: int,
) -> ShardPlan:
    """Which rank writes which flat element range of each parameter: a ``"dim0"`` plan.

    The boxes of a parameter whose row ranges (dim 0) overlap form a block, rows ``[a, b)``
    x every other dim whole (they tile it); its rows are cut into chunks of
    ``ceil((b - a) / m)`` among its ``m`` boxes' ranks in the order of their corners, as
    FSDP2 cuts rows, and each chunk is one shard. A box whose other dims are whole is its own
    block and its rank writes it. A 0-d parameter is one shard of its box's rank.

    Args:
        specs: the whole parameters, in the model's order (frozen ones get no shard).
        boxes: ``distinct_boxes``'s result.
        groups: each parameter's optimizer param-group index.
        world_size: the ranks that write files.

    Returns:
        A ``ShardPlan`` of kind ``"dim0"`` whose shards tile each trainable parameter.

    Example:
        >>> left = Box(name="w", rank=0, start=(0, 0), stop=(4, 2))
        >>> right = Box(name="w", rank=1, start=(0, 2), stop=(4, 4))
        >>> plan = plan_box_shards([ParamSpec(name="w", shape=(4, 4))],
        ...     {"w": [left, right]}, {"w": 0}, world_size=2)
        >>> [(s.rank, s.start, s.stop) for s in plan.shards]
        [(0, 0, 8), (1, 8, 16)]
    """
    shards: list[Shard] = []
    for spec in specs:
        if not spec.requires_grad:
            continue
        group = groups.get(spec.name, 0)
        if not spec.shape:
            (box,) = boxes[spec.name]
            shards.append(Shard(name=spec.name, rank=box.rank, start=0, stop=1, group=group))
            continue
        row = math.prod(spec.shape[1:])
        for first, last, members in _blocks(boxes[spec.name]):
            chunk = -(-(last - first) // len(members))
            for i, box in enumerate(members):
                lo, hi = first + i * chunk, min(last, first + (i + 1) * chunk)
                if hi > lo:
                    shards.append(
                        Shard(
                            name=spec.name,
                            rank=box.rank,
                            start=lo * row,
                            stop=hi * row,
                            group=group,
                        )
                    )
    return ShardPlan(kind=DIM0, world_size=world_size, shards=tuple(shards))


def _blocks(boxes: Sequence[Box]) -> list[tuple[int, int, list[Box]]]:
    """Row ranges ``[a, b)`` of dim 0 that boxes overlapping in rows join, with the boxes."""
    out: list[tuple[int, int, list[Box]]] = []
    for box in sorted(boxes, key=lambda b: (b.start[0], b.corner)):
        if out and box.start[0] < out[-1][1]:
            first, last, members = out[-1]
            out[-1] = (first, max(last, box.stop[0]), [*members, box])
        else:
            out.append((box.start[0], box.stop[0], [box]))
    return out


def shard_region(shard: Shard, shape: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The rows a ``plan_box_shards`` shard covers, as a box corner ``(start, stop)``."""
    if not shape:
        return (), ()
    row = math.prod(shape[1:])
    return (shard.start // row, *(0,) * (len(shape) - 1)), (shard.stop // row, *shape[1:])


def transfers(
    name: str,
    boxes: Sequence[Box],
    target: int,
    start: Sequence[int],
    stop: Sequence[int],
) -> tuple[Transfer, ...]:
    """What each box's rank gives ``target`` so that it holds ``[start, stop)`` of ``name``.

    Args:
        name: the parameter.
        boxes: its ``distinct_boxes`` (one replica each).
        target: the rank that assembles the region.
        start, stop: the region, per dim.

    Returns:
        One transfer per box that overlaps the region (``source == target`` for what the
        target holds itself), in the boxes' order; their parts tile the region.
    """
    out = []
    for box in boxes:
        lo = tuple(max(a, b) for a, b in zip(box.start, start, strict=True))
        hi = tuple(min(a, b) for a, b in zip(box.stop, stop, strict=True))
        if all(a < b for a, b in zip(lo, hi, strict=True)):
            out.append(Transfer(name=name, source=box.rank, target=target, start=lo, stop=hi))
    return tuple(out)


def plan_weight_owners(plan: ShardPlan, specs: Sequence[ParamSpec]) -> dict[str, int]:
    """The rank that writes each weight whole: of the ranks that write a range of its state,
    the one with the fewest weight bytes so far (ties: the lowest rank), parameters in the
    order given, so the gathered weights spread over the writers as the state does.

    Example:
        >>> specs = [ParamSpec(name=n, shape=(4,)) for n in "ab"]
        >>> both = plan_box_shards(specs, {n: [Box(name=n, rank=r, start=(2 * r,),
        ...     stop=(2 * r + 2,)) for r in (0, 1)] for n in "ab"}, {}, world_size=2)
        >>> plan_weight_owners(both, specs)
        {'a': 0, 'b': 1}
    """
    writers: dict[str, set[int]] = {}
    for shard in plan.shards:
        if shard.stop > shard.start:
            writers.setdefault(shard.name, set()).add(shard.rank)
    load = [0] * plan.world_size
    owners = {}
    for spec in specs:
        ranks = sorted(writers.get(spec.name, {0}))
        owner = min(ranks, key=lambda r: (load[r], r))
        owners[spec.name] = owner
        load[owner] += spec.nbytes
    return owners
