"""Checkpoints that cross layouts: saved under any mix of tp, cp, ep, pp and dp, loaded under any.

See docs/checkpoints.md, "A checkpoint that crosses layouts".

Each rank describes what it holds as ``Held`` pieces: the whole model's parameter name, its
local parameter (a ``DTensor`` under ``fully_shard``) and its ``Box`` of the whole tensor
(``box_of``). ``save_boxes`` writes a standard gradsync checkpoint in model space (format
version 2, a ``"dim0"`` plan of flat element ranges, weights whole in their owner's file,
``gradsync_core.checkpoint._boxes``): the ranks first move the rows each one writes from the
boxes that hold them (point-to-point, one parameter at a time), so every element is written
once. Every gradsync loader reads it: ``load_boxes`` under another layout,
``load_optimizer_state_dict`` and ``load_model_weights`` in one process, gradsync_jax's
loaders. ``load_boxes`` reads only the byte ranges of each rank's boxes
(``box_windows`` -> ``state_reads`` / ``weight_reads``), checks everything on every rank, and
changes nothing unless every rank can load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple, overload

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradsync_core import Manifest, ParamSpec
from gradsync_core.checkpoint import (
    Box,
    CheckpointError,
    SaveHandle,
    box_windows,
    data_extra,
    data_range,
    distinct_boxes,
    error_message,
    hash_share,
    open_checkpoint_file,
    plan_box_shards,
    plan_weight_owners,
    read_header,
    reading_version,
    resolve_checkpoint,
    restore_data,
    shard_region,
    state_reads,
    transfers,
    verify_file_hashes,
    weight_owners,
    weight_reads,
)
from gradsync_torch._optim_state import NOT_HYPER, RankGroup, StatePiece, optimizer_name
from gradsync_torch._specs import dtype_name
from gradsync_torch.checkpoint import zero as checkpoint
from gradsync_torch.checkpoint.json_values import from_json, to_json
from gradsync_torch.checkpoint.save_agreement import RankSaveAgreement
from gradsync_torch.param_sharding._rows import as_row_sharded, held_rows


class Held(NamedTuple):
    """One parameter as a rank holds it: the whole model's ``name``, the local ``param`` (the
    optimizer's), and its ``box`` of the whole tensor (``box_of``)."""

    name: str
    param: torch.Tensor
    box: Box


def box_of(
    name: str,
    param: torch.Tensor,
    shape: Sequence[int],
    *,
    dim: int | None = None,
    offset: int = 0,
) -> Held:
    """What this rank holds of parameter ``name`` (whole shape ``shape``).

    Args:
        name: the whole model's name (``layers.3.attention.wo.weight``).
        param: the local parameter: the whole one, a slice of it (tensor parallelism, experts),
            and/or the rows ``fully_shard`` left here (a ``DTensor``).
        shape: the whole parameter's shape.
        dim, offset: for a slice, the dim it is cut along and where it starts (a row-parallel
            weight of ``tp`` rank ``t``: ``dim=1``, ``offset=t * width``).

    Returns:
        The ``Held`` piece: its box is the slice, narrowed to the rows ``fully_shard`` keeps.

    Raises:
        ValueError: a local shape that is not the whole shape with ``dim`` narrowed.

    Example:
        >>> box_of("w", torch.zeros(4, 2), (4, 8), dim=1, offset=2).box.stop  # doctest: +SKIP
        (4, 4)
    """
    shape = tuple(shape)
    local = tuple(param.shape)  # a DTensor's is its global (unsharded over dp) shape
    start, stop = [0] * len(shape), list(shape)
    if dim is not None:
        start[dim], stop[dim] = offset, offset + (local[dim] if dim < len(local) else 0)
    expected = tuple(b - a for a, b in zip(start, stop, strict=True))
    if local != expected:
        raise ValueError(
            f"{name!r} is {local} here but its whole shape {shape} narrowed along dim {dim} "
            f"is {expected}; pass the whole model's shape and the dim the slice is cut along"
        )
    if isinstance(param, DTensor):
        rows = held_rows(param)
        start[0], stop[0] = start[0] + rows[0], start[0] + rows[1]
    box = Box(name=name, rank=dist.get_rank(), start=tuple(start), stop=tuple(stop))
    return Held(name, param, box)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _world() -> RankGroup:
    return RankGroup(None, dist.get_rank(), dist.get_world_size())


class _Layout(NamedTuple):
    """Every rank's boxes, and what the save needs from each: its state keys and scalars."""

    specs: list[ParamSpec]  # group-major, the order names are stored in
    groups: list[dict[str, Any]]  # hyper-parameters and names per param group
    boxes: dict[str, list[Box]]  # distinct_boxes
    keys: dict[str, list[str]]  # tensor state keys per parameter
    scalars: dict[str, dict[str, Any]]  # 0-d state per parameter


def _record(held: Sequence[Held], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What this rank tells the others about its pieces (small, JSON-like)."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    pieces = []
    for piece in held:
        if id(piece.param) not in group_of:
            raise ValueError(f"{piece.name!r} is not a parameter of this rank's optimizer")
        state = optimizer.state.get(piece.param, {})
        tensors = sorted(k for k, v in state.items() if torch.is_tensor(v) and v.dim() >= 1)
        scalars = {
            k: to_json(v, f"state {k!r} of {piece.name!r}")
            for k, v in state.items()
            if k not in tensors and v is not None
        }
        pieces.append(
            (
                piece.name,
                piece.box.start,
                piece.box.stop,
                group_of[id(piece.param)],
                tensors,
                scalars,
                dtype_name(piece.param.dtype),
            )
        )
    held_ids = {id(p.param) for p in held}
    missing = [i for i in group_of if i not in held_ids]
    if missing:
        raise ValueError(
            f"{len(missing)} parameter(s) of this rank's optimizer are in no Held piece; "
            "describe every parameter the optimizer steps"
        )
    hyper = [
        {k: to_json(v, f"hyper-parameter {k!r}") for k, v in g.items() if k not in NOT_HYPER}
        for g in optimizer.param_groups
    ]
    return {"pieces": pieces, "hyper": hyper, "optimizer": optimizer_name(type(optimizer))}


def _layout(records: Sequence[Mapping[str, Any]], specs: Sequence[ParamSpec]) -> _Layout:
    """Every rank's records as one plan input, checked: one optimizer, one group per
    parameter, the same state keys on every holder, the boxes tiling each parameter."""
    if len({r["optimizer"] for r in records}) > 1:
        raise ValueError("the ranks step different optimizer classes; use one on every rank")
    boxes: list[Box] = []
    group: dict[str, int] = {}
    keys: dict[str, list[str]] = {}
    scalars: dict[str, dict[str, Any]] = {}
    hyper: dict[int, dict[str, Any]] = {}
    dtypes = {s.name: s.dtype for s in specs}
    for rank, record in enumerate(records):
        for name, start, stop, g, tensors, values, dtype in record["pieces"]:
            boxes.append(Box(name=name, rank=rank, start=tuple(start), stop=tuple(stop)))
            if name in dtypes and dtype != dtypes[name]:
                raise ValueError(
                    f"{name!r} is {dtype} on rank {rank} but {dtypes[name]} in the model's "
                    "specs; describe the model as it is trained"
                )
            if keys.setdefault(name, tensors) != tensors or group.setdefault(name, g) != g:
                raise ValueError(
                    f"the ranks holding {name!r} keep different optimizer state or param "
                    "groups for it; build every rank's optimizer alike"
                )
            scalars.setdefault(name, values)
            if hyper.setdefault(g, record["hyper"][g]) != record["hyper"][g]:
                raise ValueError(
                    f"param group {g} has other hyper-parameters on rank {rank}; build every "
                    "rank's optimizer alike"
                )
    frozen = [s.name for s in specs if not s.requires_grad]
    if frozen:
        raise ValueError(
            f"{frozen[0]!r} is frozen (requires_grad=False); a checkpoint across layouts "
            "stores trained parameters only: save the frozen ones with the model's own files"
        )
    kept = distinct_boxes(boxes, specs)
    order = sorted(specs, key=lambda s: group.get(s.name, 0))
    groups = [
        {**hyper[g], "params": [s.name for s in order if group.get(s.name, 0) == g]}
        for g in sorted(hyper)
    ]
    return _Layout(order, groups, kept, keys, scalars)


def _exchange(
    name: str,
    boxes: Sequence[Box],
    box: Box,
    mine: Sequence[torch.Tensor],
    regions: Sequence[tuple[int, tuple[int, ...], tuple[int, ...]]],
) -> dict[int, list[torch.Tensor]]:
    """Move ``regions`` ``(target, start, stop)`` of parameter ``name`` to their targets.

    This rank holds ``box`` of it (one of the ``boxes`` that tile it, or a replica of one):
    ``mine`` are its tensors there (the weight and each state tensor, the same kinds on every
    holder). It sends what it holds of each region to the region's target (nothing when it is
    not the box's chosen replica) and returns the regions it is the target of, by index,
    assembled. Point-to-point (``batch_isend_irecv``), tags counted alike on every rank.
    """
    me, ops, tag = dist.get_rank(), [], 0
    out: dict[int, list[torch.Tensor]] = {}
    received: list[tuple[torch.Tensor, torch.Tensor, tuple[slice, ...]]] = []
    for index, (target, start, stop) in enumerate(regions):
        shape = tuple(b - a for a, b in zip(start, stop, strict=True))
        if target == me:
            out[index] = [t.new_empty(shape) for t in mine]
        for part in transfers(name, boxes, target, start, stop):
            for kind, tensor in enumerate(mine):
                tag += 1
                if part.source == me:
                    held = tensor[_at(part.start, part.stop, box.start)]
                    if target == me:
                        out[index][kind][_at(part.start, part.stop, start)] = held
                    else:
                        ops.append(dist.P2POp(dist.isend, held.contiguous(), target, tag=tag))
                elif target == me:
                    buffer = tensor.new_empty(part.shape)
                    ops.append(dist.P2POp(dist.irecv, buffer, part.source, tag=tag))
                    received.append((out[index][kind], buffer, _at(part.start, part.stop, start)))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    for region, buffer, where in received:
        region[where] = buffer
    return out


def _at(start: Sequence[int], stop: Sequence[int], origin: Sequence[int]) -> tuple[slice, ...]:
    """The slices of ``[start, stop)`` in a tensor whose first element is at ``origin``."""
    return tuple(slice(a - o, b - o) for a, b, o in zip(start, stop, origin, strict=True))


@overload
def save_boxes(
    path: str | os.PathLike[str],
    held: Sequence[Held],
    optimizer: torch.optim.Optimizer,
    *,
    specs: Sequence[ParamSpec],
    layout: Mapping[str, Any] | None = None,
    data: Any = None,
    blocking: Literal[True] = True,
) -> None: ...


@overload
def save_boxes(
    path: str | os.PathLike[str],
    held: Sequence[Held],
    optimizer: torch.optim.Optimizer,
    *,
    specs: Sequence[ParamSpec],
    layout: Mapping[str, Any] | None = None,
    data: Any = None,
    blocking: Literal[False],
) -> SaveHandle: ...


def save_boxes(
    path: str | os.PathLike[str],
    held: Sequence[Held],
    optimizer: torch.optim.Optimizer,
    *,
    specs: Sequence[ParamSpec],
    layout: Mapping[str, Any] | None = None,
    data: Any = None,
    blocking: bool = True,
) -> SaveHandle | None:
    """Write a checkpoint of a model laid out on any topology (a collective over the world).

    Every rank gives what it holds (``held``, from ``box_of``) and its optimizer; the
    checkpoint is the one format every gradsync loader reads, in model space: the optimizer
    state of each parameter as flat element ranges of the whole tensor, one per rank file,
    each element once; each weight whole in one file.

    Args:
        path: the checkpoint directory (switched atomically, as every gradsync save).
        held: this rank's pieces, one per parameter its optimizer steps.
        optimizer: this rank's torch optimizer (``AdamW`` over the local parameters).
        specs: the whole model's parameters (``param_specs`` of the unsharded model, e.g. on
            the meta device), in its order.
        layout: the record ``gradsync_core.checkpoint.layout_record`` makes; stored in the
            manifest as ``extra["layout"]`` (``gradsync checkpoint inspect`` prints it).
        data: a ``ResumableSampler`` whose position goes into the manifest.
        blocking: ``False``: return once this rank's state ranges and the weights it stores
            (exchanged first, as a blocking save does) are copied to host staging memory; the
            files are written in the background (``ZeroRedundancyOptimizer.save`` says how),
            so training may go on and change the parameters and state.

    Returns:
        ``None``; with ``blocking=False`` the save's ``SaveHandle`` (``wait()`` for its
        manifest).

    Raises:
        ValueError: on every rank, one sentence (``CheckpointError``): pieces that do not
            tile the model, ranks with other optimizers or state, a failed write; ``path``
            keeps its data. With ``blocking=False`` a failed write raises at the handle's
            ``wait()`` or the next save instead.

    Example:
        >>> save_boxes("ckpt/step100", model.held(), optimizer, specs=specs)  # doctest: +SKIP
        >>> handle = save_boxes("ckpt/step200", model.held(), optimizer, specs=specs,
        ...                     blocking=False)  # doctest: +SKIP
        >>> manifest = handle.wait()  # doctest: +SKIP
    """
    ranks = _world()
    what = f"cannot save checkpoint {os.fspath(path)}"
    try:
        record, error = _record(held, optimizer), None
    except ValueError as e:
        record, error = None, str(e)
    RankSaveAgreement(ranks).all_ok(error, what)
    records: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(records, record)
    try:
        plan_input = _layout(records, specs)
    except ValueError as e:  # every rank finds the same in the same records: no agreement
        raise CheckpointError(f"{what}: {e}") from None
    order = plan_input.specs
    index = {spec.name: i for i, spec in enumerate(order)}
    groups = {n: g for g, group in enumerate(plan_input.groups) for n in group["params"]}
    plan = plan_box_shards(order, plan_input.boxes, groups, world_size=ranks.world_size)
    owners = plan_weight_owners(plan, order)
    pieces, weights = _gather(plan_input, plan, owners, {p.name: p for p in held}, optimizer)
    step = max((int(v["step"]) for v in plan_input.scalars.values() if "step" in v), default=0)
    snapshot = checkpoint.Snapshot(
        optimizer=records[0]["optimizer"],
        step=step,
        shard_gradients=True,
        names=[spec.name for spec in order],
        specs=order,
        plan=plan,
        param_groups=plan_input.groups,
        pieces=[p._replace(index=index[_name(p, order)]) for p in pieces],
        data=data_extra(data),
        weights=weights,
        weight_owners=owners,
        layout=dict(layout) if layout is not None else None,
    )
    return checkpoint.save(path, snapshot, ranks, what=what, blocking=blocking)


def _name(piece: StatePiece, order: Sequence[ParamSpec]) -> str:
    return order[piece.index].name


def _gather(
    layout: _Layout,
    plan: Any,
    owners: Mapping[str, int],
    held: Mapping[str, Held],
    optimizer: torch.optim.Optimizer,
) -> tuple[list[StatePiece], dict[str, torch.Tensor]]:
    """The state pieces this rank writes (flat element ranges, ``plan``'s shards of it) and
    the whole weights it owns, moved here from the boxes that hold them, one parameter at a
    time."""
    pieces, weights = [], {}
    for i, spec in enumerate(layout.specs):
        piece = held.get(spec.name)
        if piece is None:
            continue  # this rank holds none of it: no transfer involves it
        state = optimizer.state.get(piece.param, {})
        keys = layout.keys.get(spec.name, [])
        weight = [_local(piece.param.detach()).reshape(piece.box.shape)]
        whole = ((0,) * len(spec.shape), tuple(spec.shape))
        owner = [(owners[spec.name], *whole)]
        got = _exchange(spec.name, layout.boxes[spec.name], piece.box, weight, owner)
        if 0 in got:
            weights[spec.name] = got[0][0].contiguous()
        if not keys:
            continue  # no state yet (never stepped): the manifest lists the keys as none
        mine = [_local(state[k]).reshape(piece.box.shape) for k in keys]
        shards = [s for s in plan.shards if s.name == spec.name]
        regions = [(s.rank, *shard_region(s, spec.shape)) for s in shards]
        got = _exchange(spec.name, layout.boxes[spec.name], piece.box, mine, regions)
        for j, shard in enumerate(shards):
            if j in got:
                flat = {k: t.reshape(-1) for k, t in zip(keys, got[j], strict=True)}
                flat.update(layout.scalars.get(spec.name, {}))
                pieces.append(StatePiece(i, shard.start, shard.stop, False, flat))
    return pieces, weights


# safetensors dtype names -> torch, for the element ranges a load reads.
_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
}


class _Loaded(NamedTuple):
    manifest: Manifest
    values: dict[str, dict[str, Any]]  # name -> {"weight": tensor, key: tensor or number}


def load_boxes(
    path: str | os.PathLike[str],
    held: Sequence[Held],
    optimizer: torch.optim.Optimizer,
    *,
    specs: Sequence[ParamSpec],
    data: Any = None,
    allow_nonfinite: bool = False,
    allow_dtype_conversion: bool = False,
) -> Manifest:
    """Load any gradsync checkpoint holding model weights into a model laid out on any
    topology (a collective over the world); on any error every rank raises and nothing
    changes.

    Each rank reads only the byte ranges of its boxes (``box_windows``, then
    ``state_reads`` / ``weight_reads``) of the weights and the optimizer state, and hashes
    the files it reads plus its share of the others. Every check runs on every rank first:
    the model (names, shapes, dtypes), the optimizer and its state keys, the param groups,
    every rank's boxes tiling the model (another layout of the same model).

    Args:
        path: a checkpoint saved with weights (``save_boxes``, ``save_param_shards``,
            ``ZeroRedundancyOptimizer.save(model=)``, gradsync_jax's).
        held: this rank's pieces (``box_of``), one per parameter its optimizer steps.
        optimizer: this rank's torch optimizer over the local parameters.
        specs: the whole model's parameters, as ``save_boxes`` takes them.
        data: a ``ResumableSampler`` to restore the position of.
        allow_nonfinite: take NaN or inf as they are.
        allow_dtype_conversion: cast what is stored in another dtype to the parameter's.

    Returns:
        The checkpoint's manifest (``extra["layout"]``: where it was saved).

    Raises:
        ValueError: one sentence on every rank (``CheckpointError``), before anything changes.

    Example:
        >>> load_boxes("ckpt/step100", model.held(), optimizer, specs=specs)  # doctest: +SKIP
    """
    ranks = _world()
    agreement = RankSaveAgreement(ranks)
    version = agreement.share_token(resolve_checkpoint(path) if agreement.leader else None)
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    mine = [(p.name, p.box.start, p.box.stop, group_of.get(id(p.param), -1)) for p in held]
    records: list[Any] = [None] * ranks.world_size
    dist.all_gather_object(records, mine)
    error, loaded = None, None
    try:
        with reading_version(version):
            loaded = _read(
                version, held, optimizer, specs, records, allow_nonfinite, allow_dtype_conversion
            )
    except Exception as e:  # any failure must reach the other ranks, or they would load
        error = error_message(e)
    agreement.all_ok(error, f"cannot load checkpoint {os.fspath(path)}")
    assert loaded is not None
    _apply(loaded, held, optimizer)
    restore_data(dict(loaded.manifest.extra), data, os.fspath(path))
    return loaded.manifest


def _read(
    version: str,
    held: Sequence[Held],
    optimizer: torch.optim.Optimizer,
    specs: Sequence[ParamSpec],
    records: Sequence[Sequence[Any]],
    allow_nonfinite: bool,
    allow_dtype_conversion: bool,
) -> _Loaded:
    """Check everything, then read this rank's boxes; changes nothing."""
    group: dict[str, int] = {}
    boxes = []
    for rank, pieces in enumerate(records):
        for name, start, stop, g in pieces:
            boxes.append(Box(name=name, rank=rank, start=tuple(start), stop=tuple(stop)))
            if g < 0:
                raise ValueError(
                    f"rank {rank}'s piece of {name!r} is not a parameter of its optimizer; "
                    "give load_boxes the parameters the optimizer steps"
                )
            group[name] = g
    names_here = [p.name for p in held]
    if len(set(names_here)) != len(names_here):
        raise ValueError("two Held pieces on this rank name one parameter; give each once")
    described = {id(p.param) for p in held}
    stepped = [p for g in optimizer.param_groups for p in g["params"]]
    if any(id(p) not in described for p in stepped):
        raise ValueError(
            "a parameter of this rank's optimizer is in no Held piece; describe every "
            "parameter the optimizer steps"
        )
    order = sorted(specs, key=lambda s: group.get(s.name, 0))
    names = [s.name for s in order]
    count = len(optimizer.param_groups)
    groups = [
        {**optimizer.param_groups[g], "params": [n for n in names if group.get(n) == g]}
        for g in range(count)
    ]
    target = checkpoint.LoadTarget(
        optimizer_class=type(optimizer),
        names=names,
        specs=order,
        param_groups=groups,
        shapes=[tuple(s.shape) for s in order],
        needed=set(),
    )
    manifest = checkpoint._check_manifest(version, target)  # model, optimizer, keys, groups
    distinct_boxes(boxes, order)  # the new layout holds every element of this model
    shapes = {s.name: tuple(s.shape) for s in order}
    for piece in held:
        local = tuple(_local(piece.param).shape)
        if local != piece.box.shape:
            raise ValueError(
                f"{piece.name!r} is {local} on this rank but its box is {piece.box.shape}; "
                "describe each piece with box_of"
            )
    scalars = manifest.extra.get("scalars", {})
    keys = {
        p.name: [k for k in manifest.state_keys.get(p.name, ()) if f"{p.name}/{k}" not in scalars]
        for p in held
    }
    windows = {p.name: box_windows(p.box, shapes[p.name]) for p in held}
    every = [w for p in held for w in windows[p.name]]
    state = state_reads(manifest.plan, every, keys)
    weight = weight_reads(weight_owners(version, manifest), manifest.world_size, every)
    files = {r.file for r in (*state, *weight)}
    files |= set(hash_share(version, manifest, dist.get_rank(), dist.get_world_size()))
    verify_file_hashes(version, manifest, sorted(files))
    values: dict[str, dict[str, Any]] = {}
    with _Files(version) as reader:
        for piece in held:
            at, offset = {}, 0
            for window in windows[piece.name]:
                at[window], offset = offset, offset + window.numel
            kinds = {"__weight__": piece.param.dtype}
            kinds |= {k: piece.param.dtype for k in keys[piece.name]}
            flat = {k: torch.empty(piece.box.numel, dtype=d) for k, d in kinds.items()}
            reads = [(r, False) for r in state if r.window.name == piece.name]
            reads += [(r, True) for r in weight if r.window.name == piece.name]
            for read, is_weight in reads:
                for key in read.keys:
                    kind = "__weight__" if is_weight else key.rpartition("/")[2]
                    part = reader.elements(read.file, key, read.start, read.stop)
                    _check_value(
                        piece.name,
                        kind,
                        part,
                        piece.param.dtype,
                        allow_nonfinite,
                        allow_dtype_conversion,
                    )
                    first = at[read.window] + read.at
                    flat[kind][first : first + read.numel] = part
            values[piece.name] = {k: t.reshape(piece.box.shape) for k, t in flat.items()}
            for key in manifest.state_keys.get(piece.name, ()):
                if f"{piece.name}/{key}" in scalars:
                    values[piece.name][key] = scalars[f"{piece.name}/{key}"]
    return _Loaded(manifest, values)


def _check_value(
    name: str, kind: str, part: torch.Tensor, dtype: torch.dtype, nonfinite: bool, cast: bool
) -> None:
    what = "weight" if kind == "__weight__" else f"state {kind!r}"
    if part.dtype != dtype and not cast:
        raise ValueError(
            f"the {what} of {name!r} is {dtype_name(part.dtype)} in the checkpoint but "
            f"{dtype_name(dtype)} here; pass allow_dtype_conversion=True to convert it"
        )
    if not nonfinite and part.is_floating_point() and not bool(torch.isfinite(part).all()):
        raise ValueError(
            f"the {what} of {name!r} holds NaN or inf in the checkpoint; pass "
            "allow_nonfinite=True to load it as it is"
        )


class _Files:
    """Rank files of one checkpoint version, read by element ranges (their headers once)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.open: dict[str, tuple[Any, dict[str, Any], int, int]] = {}

    def __enter__(self) -> _Files:
        return self

    def __exit__(self, *_: Any) -> None:
        for handle, *_rest in self.open.values():
            handle.close()

    def elements(self, file: str, key: str, start: int, stop: int) -> torch.Tensor:
        """Elements ``[start, stop)`` of the flattened tensor ``key`` of ``file``: one seek,
        one read of their bytes."""
        if file not in self.open:
            path = os.path.join(self.directory, file)
            header, first = read_header(path)
            handle = open_checkpoint_file(self.directory, file)
            self.open[file] = (handle, header, first, os.path.getsize(path) - first)
        handle, header, first, data_bytes = self.open[file]
        entry = header.get(key)
        if entry is None:
            raise ValueError(f"checkpoint file {file} lacks {key!r}, which its plan places there")
        begin, end = data_range(file, key, entry, data_bytes)
        dtype = _DTYPES.get(entry.get("dtype"))
        if dtype is None:
            raise ValueError(f"checkpoint file {file}: {key!r} has dtype {entry.get('dtype')!r}")
        size = torch.empty((), dtype=dtype).element_size()
        if not (0 <= start <= stop and begin + stop * size <= end):
            raise ValueError(f"checkpoint file {file}: {key!r} has no elements [{start}, {stop})")
        handle.seek(first + begin + start * size)
        data = bytearray(handle.read((stop - start) * size))
        if len(data) != (stop - start) * size:
            raise ValueError(f"checkpoint file {file} is truncated in {key!r}")
        return torch.frombuffer(data, dtype=dtype) if data else torch.empty(0, dtype=dtype)


def _apply(loaded: _Loaded, held: Sequence[Held], optimizer: torch.optim.Optimizer) -> None:
    """Copy the checked values into the local parameters and the optimizer."""
    by_id = {id(p.param): p for p in held}
    state: dict[int, dict[str, Any]] = {}
    index = 0
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                piece = by_id[id(param)]
                values = dict(loaded.values[piece.name])
                local = _local(param)
                local.copy_(values.pop("__weight__").reshape(local.shape))
                if values:
                    state[index] = {
                        k: _like(v.to(param.dtype), param) if torch.is_tensor(v) else v
                        for k, v in values.items()
                    }
                index += 1
    manifest = loaded.manifest
    saved = manifest.extra.get("param_groups", []) if manifest.framework == "torch" else []
    groups, first = [], 0
    for g, group in enumerate(optimizer.param_groups):
        hyper = {k: v for k, v in group.items() if k not in NOT_HYPER}
        if g < len(saved):
            hyper = {
                k: from_json(v, group.get(k)) for k, v in saved[g].items() if k not in NOT_HYPER
            }
        count = len(group["params"])
        groups.append({**hyper, "params": list(range(first, first + count))})
        first += count
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def _like(value: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """State of ``param``'s box in the form the optimizer keeps it (a DTensor's rows)."""
    if isinstance(param, DTensor):
        return as_row_sharded(value.reshape(param.to_local().shape), param)
    return value.reshape(param.shape).clone()
