"""Resharding checkpoints for ``ZeroRedundancyOptimizer`` (docs/design.md §9).

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
import os
import re
from typing import TYPE_CHECKING, Any

import safetensors.torch
import torch
import torch.distributed as dist
from safetensors import safe_open
from torch import nn

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
from gradsync_torch._zero_state import StatePiece, assemble, load_full_state

if TYPE_CHECKING:
    from gradsync_torch._zero import ZeroRedundancyOptimizer

_RANK_FILE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")


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


def _agree(opt: ZeroRedundancyOptimizer, error: str | None, what: str) -> None:
    """Raise the first rank's error on every rank (a collective), so no rank goes on to a
    collective the failed rank never reaches (a hang)."""
    errors: list[Any] = [error]
    if opt.world_size > 1:
        errors = [None] * opt.world_size
        dist.all_gather_object(errors, error, group=opt.process_group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        where = f" (rank {rank})" if opt.world_size > 1 else ""
        raise ValueError(f"{what}{where}: {message}")


def _message(e: BaseException) -> str:
    return f"{e}" if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"


def _rank_state(
    opt: ZeroRedundancyOptimizer, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, list[str]]]:
    """This rank's tensors, non-tensor numbers and state keys, by checkpoint name."""
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
    return tensors, scalars, state_keys


def _groups_json(opt: ZeroRedundancyOptimizer, names: list[str]) -> list[dict[str, Any]]:
    out, first = [], 0
    for g, group in enumerate(opt.param_groups):
        entry = {
            k: _to_json(v, f"hyper-parameter {k!r} of param group {g}")
            for k, v in group.items()
            if k not in ("params", "param_names")
        }
        entry["params"] = names[first : first + len(group["params"])]
        first += len(group["params"])
        out.append(entry)
    return out


def save(
    opt: ZeroRedundancyOptimizer, path: str | os.PathLike[str], *, model: nn.Module | None
) -> None:
    """Write ``opt``'s state to directory ``path`` (a collective over its process group).

    Each rank writes its own file atomically; rank 0 writes the manifest after every file
    exists (the old manifest and rank files of another world size are removed first, so an
    interrupted save is never mistaken for a complete one). A failure on any rank (a state
    value that is not a number, a full disk) raises on every rank and writes no manifest.

    Raises:
        ValueError: if parameter names are unknown (see ``param_names``), or on any rank's
            failure, naming the rank.
    """
    from gradsync_torch._zero import optimizer_name

    names = opt.param_names(model)
    specs, plan = opt._specs(names), opt.plan(names)
    world, rank, group = opt.world_size, opt.rank, opt.process_group
    path, what = os.fspath(path), f"cannot save optimizer checkpoint {os.fspath(path)}"
    error = None
    try:
        groups_json = _groups_json(opt, names)
        tensors, scalars, state_keys = _rank_state(opt, names)
    except Exception as e:
        error = _message(e)
    _agree(opt, error, what)  # nothing on disk has changed yet
    if rank == 0:
        try:
            os.makedirs(path, exist_ok=True)
            if os.path.exists(os.path.join(path, MANIFEST)):
                os.unlink(os.path.join(path, MANIFEST))
            current = {rank_file(r, world) for r in range(world)}
            for name in os.listdir(path):  # rank files of an earlier save at another size
                if _RANK_FILE.fullmatch(name) and name not in current:
                    os.unlink(os.path.join(path, name))
        except Exception as e:
            error = _message(e)
    _agree(opt, error, what)  # also orders rank 0's clean-up before every write
    file_name = rank_file(rank, world)
    mine: tuple[Any, ...] = (file_name, None, {}, {}, None)
    try:
        data = safetensors.torch.save(tensors, metadata={"rank": str(rank), "world": str(world)})
        write_atomic(os.path.join(path, file_name), data)
        mine = (file_name, hashlib.sha256(data).hexdigest(), state_keys, scalars, None)
    except Exception as e:
        mine = (file_name, None, {}, {}, _message(e))
    gathered: list[Any] = [mine]
    if world > 1:
        gathered = [None] * world
        dist.gather_object(
            mine, gathered if rank == 0 else None, dst=opt._comm.global_rank(0), group=group
        )
    error = None
    if rank == 0:
        failed = [(r, g[4]) for r, g in enumerate(gathered) if g[4] is not None]
        if failed:
            error = f"rank {failed[0][0]} could not write its file: {failed[0][1]}"
        else:
            all_keys: dict[str, tuple[str, ...]] = {}
            all_scalars: dict[str, Any] = {}
            for _, _, keys, values, _ in gathered:
                all_keys.update({name: tuple(k) for name, k in keys.items()})
                all_scalars.update(values)
            manifest = Manifest(
                framework="torch",
                optimizer=optimizer_name(opt.optimizer_class),
                world_size=world,
                step=opt.steps,
                params=tuple(specs),
                plan=plan,
                state_keys=dict(sorted(all_keys.items())),
                files={f: digest for f, digest, _, _, _ in gathered},
                extra={
                    "param_groups": groups_json,
                    "scalars": all_scalars,
                    "shard_gradients": opt.shard_gradients,
                },
            )
            try:
                write_manifest(path, manifest)
            except Exception as e:
                error = _message(e)
    _agree(opt, error, what)  # nobody returns before the checkpoint is complete


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
        error = _message(e)
    _agree(opt, error, f"cannot load optimizer checkpoint {os.fspath(path)}")
    shapes = [tuple(p.shape) for p in opt._params()]
    load_full_state(opt, full, shapes, groups)
    opt._gradsync_steps = manifest.step
