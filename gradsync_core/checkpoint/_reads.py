"""Which stored element ranges a load reads to fill the windows it keeps.

A checkpoint (docs/design-checkpoints.md) stores a parameter's optimizer state as its manifest's
``ShardPlan`` says: whole tensors (greedy: the one shard spans the parameter) or 1-D element
ranges ``[start, stop)`` of the flattened tensor (flat, dim0), each in the file of the shard's
rank; model weights are stored whole, in the file of their owner (``extra["model"]``). A loader
keeps *windows*: element ranges of a flattened parameter (in torch's layout, row-major) that it
holds after the load, such as a ZeRO-3 device's rows ``[lo·k, hi·k)`` (``k`` elements per row),
or ``[0, numel)`` for a whole parameter. The reads of a window are its overlaps with the stored
pieces, each as an element range of the stored tensor (flattened), so a reader seeks to the
tensor's data offset plus ``start`` elements and reads ``stop - start`` of them: in row-major
order any element range of a stored tensor, whole or a slice, is one contiguous byte range.

So nothing outside the windows is read, whatever the layout the checkpoint was saved with (whole
tensors too). The one read that holds no element is the empty read an empty window gets (a
device that holds only padding): zero elements of the parameter's first stored piece, so that a
reader that learns dtypes from what it reads (torch's safetensors slices) still sees each
tensor's. Both executors read through these functions: gradsync_torch with safetensors slices,
gradsync_jax with byte ranges of the files.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from gradsync_core.checkpoint._format import rank_file, tensor_key
from gradsync_core.checkpoint._model_weights import model_key
from gradsync_core.plan._shards import ShardPlan


@dataclass(frozen=True, slots=True, kw_only=True)
class Window:
    """Elements ``[start, stop)`` of parameter ``name``, flattened in torch's layout, that a
    loader keeps."""

    name: str
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True, slots=True, kw_only=True)
class WindowRead:
    """Elements ``[start, stop)`` of each tensor ``keys`` that rank file ``file`` (of rank
    ``rank``) stores, counted in the stored tensor flattened: they are elements
    ``[at, at + numel)`` of ``window``, the parameter's ``[window.start + at, ...)``."""

    window: Window
    file: str
    rank: int
    keys: tuple[str, ...]
    start: int
    stop: int
    at: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


def state_reads(
    plan: ShardPlan, windows: Iterable[Window], keys: Mapping[str, Sequence[str]]
) -> tuple[WindowRead, ...]:
    """The reads of optimizer state that fill ``windows``, from a checkpoint saved with
    ``plan`` at any world size.

    Args:
        plan: the manifest's plan: which rank's file stores which elements of each parameter.
        windows: what the loader keeps; a parameter may have several windows (one per device).
        keys: each parameter's state keys (``exp_avg``), which the reads name as
            ``tensor_key(name, key)``; a parameter without an entry has no stored state and
            its windows get no reads. (0-d state a manifest holds as a number, torch's
            ``step``, is in no file: a reader takes it from the manifest.)

    Returns:
        For each window in the order given, one read per stored piece that overlaps it, in
        element order, whose keys are ``tensor_key(name, key)``; an empty window gets one empty
        read of the parameter's first stored piece.

    Raises:
        ValueError: if some element of a window is stored in no rank file, or in two (a plan
            whose pieces do not tile the parameter).

    Example:
        >>> from gradsync_core import ParamSpec, plan_flat_shards, plan_buckets
        >>> specs = [ParamSpec(name="w", shape=(4, 3))]
        >>> plan = plan_flat_shards(plan_buckets(specs, pad_to=2), world_size=2)
        >>> [(r.file, r.start, r.stop, r.at)
        ...  for r in state_reads(plan, [Window(name="w", start=3, stop=9)], {"w": ["exp_avg"]})]
        [('rank-00000-of-00002.safetensors', 3, 6, 0), ('rank-00001-of-00002.safetensors', 0, 3, 3)]
    """
    pieces: dict[str, list[tuple[int, int, int]]] = {}
    for shard in plan.shards:
        if shard.stop > shard.start:  # an empty shard stores nothing
            pieces.setdefault(shard.name, []).append((shard.rank, shard.start, shard.stop))
    out: list[WindowRead] = []
    for window in windows:
        if window.name in keys and window.name in pieces:
            names = tuple(tensor_key(window.name, key) for key in keys[window.name])
            stored = sorted(pieces[window.name], key=lambda p: p[1])
            out += _reads(window, stored, names, plan.world_size)
    return tuple(out)


def weight_reads(
    owners: Mapping[str, int], world_size: int, windows: Iterable[Window]
) -> tuple[WindowRead, ...]:
    """The reads of model weights that fill ``windows``: each weight is stored whole, as
    ``model_key(name)``, in the file of its owner.

    Args:
        owners: the rank whose file holds each weight (the manifest's ``extra["model"]``).
        world_size: the checkpoint's world size (it names the files).
        windows: what the loader keeps of each weight.

    Returns:
        One read per window (an empty one for an empty window), in the order given.

    Raises:
        ValueError: if a window names a weight ``owners`` does not list.

    Example:
        >>> [(r.file, r.keys, r.start, r.stop)
        ...  for r in weight_reads({"w": 1}, 2, [Window(name="w", start=3, stop=6)])]
        [('rank-00001-of-00002.safetensors', ('__model__/w',), 3, 6)]
    """
    out: list[WindowRead] = []
    for window in windows:
        if window.name not in owners:
            raise ValueError(f"the checkpoint stores no weight of {window.name!r}")
        whole = [(owners[window.name], 0, window.stop)]  # stored whole: element e at e
        out += _reads(window, whole, (model_key(window.name),), world_size)
    return tuple(out)


def _reads(
    window: Window, stored: Sequence[tuple[int, int, int]], keys: tuple[str, ...], world: int
) -> list[WindowRead]:
    """The overlaps of ``window`` with ``stored`` pieces ``(rank, start, stop)`` (element
    ranges of the parameter, sorted by start), checked to tile the window."""

    def read(rank: int, first: int, start: int, stop: int) -> WindowRead:
        return WindowRead(
            window=window,
            file=rank_file(rank, world),
            rank=rank,
            keys=keys,
            start=start - first,
            stop=stop - first,
            at=start - window.start,
        )

    if window.start >= window.stop:  # zero elements of the first piece, at its start
        rank, first, _ = stored[0]
        return [replace(read(rank, first, first, first), at=0)]
    out, cursor = [], window.start
    for rank, first, last in stored:
        start, stop = max(first, window.start), min(last, window.stop)
        if start >= stop:
            continue
        if start != cursor:  # a gap before this piece, or an overlap with the previous one
            _refuse(window.name, min(start, cursor), twice=start < cursor)
        out.append(read(rank, first, start, stop))
        cursor = stop
    if cursor != window.stop:
        _refuse(window.name, cursor, twice=False)
    return out


def _refuse(name: str, element: int, *, twice: bool) -> None:
    where = "in two rank files" if twice else "in no rank file"
    raise ValueError(
        f"the checkpoint's plan stores element {element} of {name!r} {where}; the manifest is "
        "corrupt: restore it or save again"
    )
