"""Resharding checkpoints for ``ZeroRedundancyOptimizer`` (DESIGN §9).

The format is gradsync_core's (``gradsync_core._checkpoint``): a directory with one
safetensors file per rank holding ``"<param name>/<state key>"`` tensors in model space and
a ``manifest.json`` written last by rank 0 (plan, world size, step, state keys, sha256 per
file). A ZeRO-1 (greedy) rank file holds whole, parameter-shaped state tensors; a ZeRO-2
(flat) rank file holds, under the same key, the 1-D slice ``[start, stop)`` of the flattened
state named by that rank's shard in the manifest's plan (0-d state such as Adam's ``step`` is
stored whole with every slice). Numbers that are not tensors go to the manifest's
``extra["scalars"]``; param-group hyper-parameters to ``extra["param_groups"]``.

Loading at any world size re-plans: each rank assembles only the parameters it now owns
from the files holding them. Every rank validates before any rank changes state, and the
ranks agree on the outcome, so a failed load leaves every optimizer untouched.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

from gradsync_core import ShardPlan
from gradsync_core._checkpoint import (
    MANIFEST,
    Manifest,
    check_compatible,
    rank_file,
    read_manifest,
    sha256_file,
    tensor_key,
    write_atomic,
    write_manifest,
)

if TYPE_CHECKING:
    from gradsync_torch._zero import ZeroRedundancyOptimizer
    from gradsync_torch._zero_layout import Piece

_RANK_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")

# (global index, start, stop, whole, state): a piece of one parameter's state in model space.
StatePiece = tuple[int, int, int, bool, dict[str, Any]]


def assemble(pieces: Sequence[StatePiece], shapes: Sequence[tuple[int, ...]]) -> dict[int, Any]:
    """Per-parameter state from pieces: whole ones as they are; flat slices concatenated in
    element order and reshaped to the parameter (0-d entries taken from the first slice).

    Raises:
        ValueError: if the slices of a parameter do not cover it exactly once.
    """
    by_index: dict[int, list[StatePiece]] = defaultdict(list)
    for piece in pieces:
        by_index[piece[0]].append(piece)
    full: dict[int, Any] = {}
    for index, parts in by_index.items():
        if len(parts) == 1 and parts[0][3]:
            full[index] = parts[0][4]
            continue
        parts.sort(key=lambda p: p[1])
        numel, cursor = math.prod(shapes[index]), 0
        for _, start, stop, _, _ in parts:
            if start != cursor:
                break
            cursor = stop
        if cursor != numel:
            raise ValueError(
                f"the state slices of parameter #{index} cover elements up to {cursor} of "
                f"{numel}: a rank file is missing or from another save"
            )
        state = {}
        for key, first in parts[0][4].items():
            if torch.is_tensor(first) and first.dim() >= 1:
                state[key] = torch.cat([p[4][key].reshape(-1) for p in parts]).view(shapes[index])
            else:
                state[key] = first
        full[index] = state
    return full


def slice_state(state: dict[str, Any], piece: Piece, shape: tuple[int, ...]) -> dict[str, Any]:
    """The part of one parameter's model-space ``state`` that ``piece`` steps.

    Raises:
        ValueError: if a tensor is neither 0-d nor the parameter's size (such state cannot
            be cut into element ranges).
    """
    if piece.whole:
        return dict(state)
    numel, out = math.prod(shape), {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() >= 1:
            if value.numel() != numel:
                raise ValueError(
                    f"state {key!r} of parameter #{piece.index} has {value.numel()} elements, "
                    f"not the parameter's {numel}; it cannot be sharded by element ranges"
                )
            out[key] = value.reshape(-1)[piece.start : piece.stop].clone()
        else:
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def local_pieces(opt: ZeroRedundancyOptimizer, *, cpu: bool = False) -> list[StatePiece]:
    """This rank's state in model space: one ``StatePiece`` per piece that has state."""
    out = []
    for p in opt.layout.pieces:
        state = opt.optim.state.get(p.tensor)
        if state:
            if cpu:
                state = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in state.items()
                }
            out.append((p.index, p.start, p.stop, p.whole, state))
    return out


def consolidate(opt: ZeroRedundancyOptimizer, to: int) -> dict[int, Any] | None:
    """Every rank's state, assembled per parameter on group rank ``to`` (a collective)."""
    mine = local_pieces(opt, cpu=True)
    gathered: list[Any] | None = [mine]
    if opt.world_size > 1:
        gathered = [None] * opt.world_size if opt.rank == to else None
        dist.gather_object(mine, gathered, dst=opt._comm.global_rank(to), group=opt.process_group)
    if gathered is None:
        return None
    shapes = [tuple(p.shape) for p in opt._params()]
    return assemble([piece for pieces in gathered for piece in pieces], shapes)


def carry_state(opt: ZeroRedundancyOptimizer, old_plan: ShardPlan, old: list[StatePiece]) -> None:
    """Give the pieces of a rebuilt layout their state: kept pieces keep theirs; if any
    piece changed owner or range (a frozen parameter became trainable, a re-plan), every
    rank's state travels through model space to the new owners (rare: one all-gather)."""
    before = {(s.name, s.start, s.stop): s.rank for s in old_plan.shards}
    after = {(s.name, s.start, s.stop): s.rank for s in opt.layout.plan.shards}
    moved = any(k in after and after[k] != r for k, r in before.items()) or any(
        k not in after for k in before
    )
    kept = {(i, start, stop): state for i, start, stop, _, state in old}
    full: dict[int, Any] = {}
    if moved and opt.world_size > 1:
        gathered: list[Any] = [None] * opt.world_size
        mine = [
            (i, a, b, w, {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()})
            for i, a, b, w, st in old
        ]
        dist.all_gather_object(gathered, mine, group=opt.process_group)
        shapes = [tuple(p.shape) for p in opt._params()]
        full = assemble([piece for pieces in gathered for piece in pieces], shapes)
    elif moved:
        full = assemble(old, [tuple(p.shape) for p in opt._params()])
    params = opt._params()
    for piece in opt.layout.pieces:
        state = kept.get((piece.index, piece.start, piece.stop))
        if state is None and piece.index in full:
            state = slice_state(full[piece.index], piece, tuple(params[piece.index].shape))
        if state is not None:
            device = piece.tensor.device
            opt.optim.state[piece.tensor] = {
                k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()
            }


def load_full_state(
    opt: ZeroRedundancyOptimizer,
    full: dict[int, dict[str, Any]],
    shapes: list[tuple[int, ...]],
    groups: list[dict[str, Any]],
) -> None:
    """Hand this rank's slices of ``full`` (model-space state by global index) and the
    hyper-parameters of ``groups`` to the local optimizer's own ``load_state_dict``, which
    casts state to each parameter's dtype and device as torch does."""
    pieces = opt._local_pieces()
    local_state = {}
    for local_index, piece in enumerate(pieces):
        if piece.index in full:
            local_state[local_index] = slice_state(full[piece.index], piece, shapes[piece.index])
    local_groups, position = [], 0
    for g, group in enumerate(groups):
        count = sum(1 for p in pieces if p.group == g)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        local_groups.append({**hyper, "params": list(range(position, position + count))})
        position += count
    for src, dst in zip(groups, opt.param_groups, strict=True):
        dst.update({k: v for k, v in src.items() if k not in ("params", "param_names")})
    opt.optim.load_state_dict({"state": local_state, "param_groups": local_groups})


def _to_json(value: Any, what: str) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [_to_json(v, what) for v in value]
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise ValueError(f"cannot save {what} = {value!r}: not a number, string or tuple of them")


def _from_json(value: Any, current: Any) -> Any:
    """A saved hyper-parameter in the type the optimizer holds now (tuples, 0-d tensors)."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(_from_json(v, c) for v, c in zip(value, current, strict=False))
    if torch.is_tensor(current) and not torch.is_tensor(value):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    return value


def save(
    opt: ZeroRedundancyOptimizer, path: str | os.PathLike[str], *, model: nn.Module | None
) -> None:
    """Write ``opt``'s state to directory ``path`` (a collective over its process group).

    Each rank writes its own file atomically; rank 0 writes the manifest after every file
    exists (the old manifest and rank files of another world size are removed first, so an
    interrupted save is never mistaken for a complete one).

    Raises:
        ValueError: if parameter names are unknown (see ``param_names``) or a state value
            is neither a tensor nor a number.
    """
    from gradsync_torch._zero import optimizer_name

    names = opt.param_names(model)
    specs, plan = opt._specs(names), opt.plan(names)
    world, rank, group = opt.world_size, opt.rank, opt.process_group
    path = os.fspath(path)
    if rank == 0:
        os.makedirs(path, exist_ok=True)
        if os.path.exists(os.path.join(path, MANIFEST)):
            os.unlink(os.path.join(path, MANIFEST))
        current = {rank_file(r, world) for r in range(world)}
        for name in os.listdir(path):  # rank files of an earlier save at another world size
            if _RANK_FILE.fullmatch(name) and name not in current:
                os.unlink(os.path.join(path, name))
    if world > 1:
        dist.barrier(group=group)
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    state_keys: dict[str, list[str]] = {}
    for piece in opt.layout.pieces:
        name, keys = names[piece.index], []
        for key, value in opt.optim.state.get(piece.tensor, {}).items():
            if value is None:
                continue
            if torch.is_tensor(value):
                tensors[tensor_key(name, key)] = value.detach().cpu().contiguous()
            else:
                scalars[tensor_key(name, key)] = _to_json(value, f"state {key!r} of {name!r}")
            keys.append(key)
        if keys:
            state_keys[name] = keys
    data = safetensors.torch.save(tensors, metadata={"rank": str(rank), "world_size": str(world)})
    file_name = rank_file(rank, world)
    write_atomic(os.path.join(path, file_name), data)
    mine = (file_name, hashlib.sha256(data).hexdigest(), state_keys, scalars)
    gathered: list[Any] = [mine]
    if world > 1:
        gathered = [None] * world
        dist.gather_object(
            mine, gathered if rank == 0 else None, dst=opt._comm.global_rank(0), group=group
        )
    if rank == 0:
        all_keys: dict[str, tuple[str, ...]] = {}
        all_scalars: dict[str, Any] = {}
        for _, _, keys, values in gathered:
            all_keys.update({name: tuple(k) for name, k in keys.items()})
            all_scalars.update(values)
        groups_json = []
        for g, group_dict in enumerate(opt.param_groups):
            entry = {
                k: _to_json(v, f"hyper-parameter {k!r} of param group {g}")
                for k, v in group_dict.items()
                if k not in ("params", "param_names")
            }
            first = sum(len(pg["params"]) for pg in opt.param_groups[:g])
            entry["params"] = names[first : first + len(group_dict["params"])]
            groups_json.append(entry)
        manifest = Manifest(
            framework="torch",
            optimizer=optimizer_name(opt.optimizer_class),
            world_size=world,
            step=opt.steps,
            params=tuple(specs),
            plan=plan,
            state_keys=dict(sorted(all_keys.items())),
            files={f: digest for f, digest, _, _ in gathered},
            extra={
                "param_groups": groups_json,
                "scalars": all_scalars,
                "shard_gradients": opt.shard_gradients,
            },
        )
        write_manifest(path, manifest)
    if world > 1:
        dist.barrier(group=group)  # nobody returns before the checkpoint is complete


def _read(
    opt: ZeroRedundancyOptimizer, path: str, names: list[str]
) -> tuple[Manifest, dict[int, Any], list[dict[str, Any]]]:
    """Validate the checkpoint and read this rank's state; touches nothing."""
    from gradsync_torch._zero import optimizer_name

    manifest = read_manifest(path, verify_files=False)
    if manifest.framework != "torch":
        raise ValueError(f"{path} was written by the {manifest.framework} executor; load it there")
    check_compatible(manifest, opt._specs(names), optimizer=optimizer_name(opt.optimizer_class))
    saved_groups = manifest.extra.get("param_groups", [])
    bounds = [0]
    for group in opt.param_groups:
        bounds.append(bounds[-1] + len(group["params"]))
    mine = [names[a:b] for a, b in itertools.pairwise(bounds)]
    theirs = [list(g.get("params", [])) for g in saved_groups]
    if mine != theirs:
        raise ValueError(
            f"param groups differ: {len(theirs)} group(s) of {[len(g) for g in theirs]} "
            f"parameters in the checkpoint, {len(mine)} of {[len(g) for g in mine]} here; "
            "build the optimizer with the same param groups before loading"
        )
    expected = {rank_file(r, manifest.world_size) for r in range(manifest.world_size)}
    if set(manifest.files) != expected:
        raise ValueError(f"{path}/{MANIFEST} does not list one file per saved rank")
    index_of = {name: i for i, name in enumerate(names)}
    needed = {piece.index for piece in opt.layout.pieces}
    shards = [
        s
        for s in manifest.plan.shards
        if index_of.get(s.name) in needed and s.name in manifest.state_keys
    ]
    to_read = {rank_file(s.rank, manifest.world_size) for s in shards}
    # Every file is hashed by some rank (and every file a rank reads, by that rank), so a
    # corrupt file fails the load everywhere even when nobody needs its tensors.
    spread = {f for i, f in enumerate(sorted(expected)) if i % opt.world_size == opt.rank}
    for file_name in sorted(to_read | spread):
        file_path = os.path.join(path, file_name)
        if not os.path.exists(file_path):
            raise ValueError(f"checkpoint file {file_path} is missing")
        if sha256_file(file_path) != manifest.files[file_name]:
            raise ValueError(
                f"checkpoint file {file_path} does not match its manifest hash: corrupt or "
                "from another save"
            )
    scalars = manifest.extra.get("scalars", {})
    whole = manifest.plan.kind == "greedy"
    pieces: list[StatePiece] = []
    handles = {f: safe_open(os.path.join(path, f), framework="pt") for f in sorted(to_read)}
    for shard in shards:
        handle = handles[rank_file(shard.rank, manifest.world_size)]
        state: dict[str, Any] = {}
        for key in manifest.state_keys[shard.name]:
            full_key = tensor_key(shard.name, key)
            state[key] = scalars[full_key] if full_key in scalars else handle.get_tensor(full_key)
        pieces.append((index_of[shard.name], shard.start, shard.stop, whole, state))
    shapes = [tuple(p.shape) for p in opt._params()]
    full = assemble(pieces, shapes)
    for index, state in full.items():
        for key, value in state.items():
            if (
                torch.is_tensor(value)
                and value.dim() >= 1
                and not whole
                and (tuple(value.shape) != shapes[index])
            ):
                raise ValueError(f"state {key!r} of {names[index]!r} has the wrong shape")
    groups = []
    for saved, current in zip(saved_groups, opt.param_groups, strict=True):
        hyper = {k: _from_json(v, current.get(k)) for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": current["params"]})
    return manifest, full, groups


def load(
    opt: ZeroRedundancyOptimizer, path: str | os.PathLike[str], *, model: nn.Module | None
) -> None:
    """Load a checkpoint written at any world size into ``opt`` (a collective).

    Raises:
        ValueError: on every rank, naming the first rank's problem (missing or corrupt
            file, another model or optimizer class, other param groups); no rank's state
            is changed.
    """
    names = opt.param_names(model)
    error: str | None = None
    try:
        manifest, full, groups = _read(opt, os.fspath(path), names)
    except Exception as e:  # any failure must reach the other ranks, or they would load
        error = f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    errors: list[Any] = [error]
    if opt.world_size > 1:
        errors = [None] * opt.world_size
        dist.all_gather_object(errors, error, group=opt.process_group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        where = f" (rank {rank})" if opt.world_size > 1 else ""
        raise ValueError(f"cannot load optimizer checkpoint {os.fspath(path)}{where}: {message}")
    shapes = [tuple(p.shape) for p in opt._params()]
    load_full_state(opt, full, shapes, groups)
    opt._gradsync_steps = manifest.step
