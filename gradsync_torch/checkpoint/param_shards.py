"""Checkpoints of a ``fully_shard``-ed model (ZeRO-3) and its torch optimizer (docs/torch-zero3.md).

The files are the ones every gradsync saver writes (format version 2, docs/design.md §9):
optimizer state in model space, keyed by torch names, so a ZeRO-3 save at N ranks loads into
ZeRO-3 at M, into ``ZeroRedundancyOptimizer`` (ZeRO-1/2), into a plain torch optimizer and
into gradsync_jax, and back. Each rank writes what it holds (under HSDP, the ranks of replica
0, its shard group: the other replicas hold the same rows, and wait): the state of its dim-0 rows of
every parameter, padding stripped, as the element ranges of a ``"dim0"`` shard plan
(``gradsync_core.checkpoint.plan_dim0_shards``). The model's weights are gathered one
parameter at a time and written whole by their owner (``model_owners``), as the other savers
store them. Saving and loading go through ``checkpoint.zero``'s ``save`` and ``load``: the
same switching save (``run_save``), the same checks before any rank changes, the same
agreement and refusals; a load reads only each rank's rows of the state (``windows``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, cast, overload

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync_core.checkpoint import SaveHandle, data_extra, plan_dim0_shards, restore_data
from gradsync_core.deprecation import deprecated_alias
from gradsync_torch._optim_rules import StepsWholeTensors
from gradsync_torch._optim_state import (
    OwnsShardedState,
    RankGroup,
    StatePiece,
    optimizer_name,
    param_specs_of,
    parameter_names,
)
from gradsync_torch._specs import unwrapped
from gradsync_torch.agreement import agree_ok
from gradsync_torch.checkpoint import zero as checkpoint
from gradsync_torch.checkpoint.model_state import copy_weights
from gradsync_torch.checkpoint.plain import loaded_state_dict
from gradsync_torch.param_sharding._rows import (
    as_row_sharded,
    check_row_sharded,
    held_elements,
    shard_dim,
    shard_mesh,
)


class _Sharded:
    """A sharded model and its optimizer as the savers see them: names, ranks, parameters."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        if isinstance(optimizer, StepsWholeTensors):
            raise ValueError(
                "a MatrixOptimizer keeps each matrix's state on its owner and saves it itself: "
                "call its save(path) / load(path) on every rank, and give this function the "
                "model's elementwise optimizer (the AdamW of the other parameters)"
            )
        if isinstance(optimizer, OwnsShardedState):
            raise ValueError(
                "a fully_shard-ed model's parameters are already sharded: build a plain torch "
                "optimizer on them (torch.optim.AdamW(model.parameters())), not a "
                "ZeroRedundancyOptimizer"
            )
        self.model = unwrapped(model)  # a wrapper's weights are its model's
        mesh = shard_mesh(self.model.named_parameters())
        dim = shard_dim(mesh)  # HSDP: the files are the shard group's, written by replica 0
        self.ranks = RankGroup(mesh.get_group(dim), mesh.get_local_rank(dim), mesh.size(dim))
        replicated = mesh.ndim == 2 and mesh.size(0) > 1
        self.replicate_group = mesh.get_group(0) if replicated else None
        self.replica = mesh.get_local_rank(0) if replicated else 0
        self.groups = optimizer.param_groups
        self.params = [p for group in self.groups for p in group["params"]]
        self.names = parameter_names(self.groups, self.model)
        for name, param in zip(self.names, self.params, strict=True):
            check_row_sharded(f"optimizer parameter {name!r}", param)
        self.specs = param_specs_of(self.names, self.params, set())

    @property
    def group_of(self) -> list[int]:
        return [g for g, group in enumerate(self.groups) for _ in group["params"]]


def _across_replicas(sharded: _Sharded, run: Callable[[], Any], what: str) -> Any:
    """``run()``, a collective over the shard group; under HSDP every replicate group then
    hears whether it failed (each meets every shard group, so every rank hears it), and all
    raise together: no replica goes on alone, no rank is left waiting."""
    if sharded.replicate_group is None:
        return run()
    try:
        result, error = run(), None
    except ValueError as exc:
        result, error = None, str(exc)
    agree_ok(error, sharded.replicate_group, what=what)
    return result


def _piece(index: int, name: str, param: DTensor, state: dict[str, Any]) -> StatePiece | None:
    """This rank's rows of one parameter's state as a flat (element-range) piece; None if it
    holds no rows (its 0-d state, ``step``, comes from the ranks that do)."""
    start, stop = held_elements(param)
    if stop <= start:
        return None
    flat: dict[str, Any] = {}
    for key, value in state.items():
        if isinstance(value, DTensor):
            value = check_row_sharded(f"state {key!r} of {name!r}", value).to_local()
            flat[key] = value.reshape(-1)
        elif torch.is_tensor(value) and value.dim() >= 1:
            raise ValueError(
                f"state {key!r} of {name!r} is a whole {tuple(value.shape)} tensor beside a "
                "sharded parameter; a ZeRO-3 save stores the optimizer's per-row state "
                "(DTensors, as torch.optim keeps for DTensor parameters)"
            )
        else:
            flat[key] = value
    return StatePiece(index, start, stop, False, flat)


def _gather_weights(
    named: Sequence[tuple[str, nn.Parameter]], owners: dict[str, int], rank: int
) -> dict[str, torch.Tensor]:
    """Every parameter's whole weight gathered in turn (a collective: every rank calls it in
    ``named_parameters()`` order), kept on the CPU by its owner only, so a rank holds one
    gathered parameter beyond what it writes."""
    weights = {}
    for name, param in named:
        whole = cast(DTensor, param.detach()).full_tensor()
        if owners[name] == rank:
            weights[name] = whole.cpu().contiguous()
    return weights


def _step(optimizer: torch.optim.Optimizer) -> int:
    steps = [
        int(state["step"]) for state in optimizer.state.values() if state.get("step") is not None
    ]
    return max(steps, default=0)


@overload
def save_param_shards(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: Any = None,
    blocking: Literal[True] = True,
) -> None: ...


@overload
def save_param_shards(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: Any = None,
    blocking: Literal[False],
) -> SaveHandle: ...


def save_param_shards(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: Any = None,
    blocking: bool = True,
) -> SaveHandle | None:
    """Write a resharding checkpoint of a ``fully_shard``-ed ``model`` and its ``optimizer``
    to directory ``path`` (a collective over the model's mesh; one shared filesystem).

    Every rank writes the optimizer state of the rows it holds, keyed by torch names in model
    space; the weights are gathered one parameter at a time and stored whole. The checkpoint
    loads at any world size into ``load_param_shards``, ``ZeroRedundancyOptimizer.load``,
    ``load_optimizer_state_dict`` (a plain optimizer) and ``gradsync_jax``'s loaders.

    Args:
        path: the checkpoint directory (switched atomically, as every gradsync save).
        model: the root module ``fully_shard`` was applied to (a wrapper's ``module`` is used).
        optimizer: a torch optimizer built on ``model``'s sharded parameters (``AdamW``, ...).
        data: a ``ResumableSampler`` whose position goes into the manifest.
        blocking: ``False``: return once this rank's rows (and the weights it stores,
            gathered first) are copied to host staging memory; the files are written in the
            background (``ZeroRedundancyOptimizer.save`` says how). Not under HSDP.

    Returns:
        ``None``; with ``blocking=False`` the save's ``SaveHandle``.

    Raises:
        ValueError: a parameter not sharded by ``fully_shard``, unknown names, or any rank's
            failure (``CheckpointError``, naming the rank); ``path`` keeps its data.

    Example:
        >>> save_param_shards("ckpt/step100", model, optimizer)  # doctest: +SKIP
    """
    sharded = _Sharded(model, optimizer)
    if not blocking:
        if sharded.replicate_group is not None:
            raise ValueError(
                "save_param_shards(blocking=False) does not support HSDP (a replicated "
                "mesh): only replica 0 writes, and the other replicas would not hear of a "
                "failure in the background; pass blocking=True"
            )
        return _save(path, sharded, optimizer, data, blocking=False)
    what = f"cannot save checkpoint {os.fspath(path)} (HSDP: written by replica 0)"
    if sharded.replica == 0:  # the other replicas hold the same rows: they wait below
        _across_replicas(sharded, lambda: _save(path, sharded, optimizer, data), what)
    else:
        _across_replicas(sharded, lambda: None, what)
    return None


def _save(
    path: Any, sharded: _Sharded, optimizer: torch.optim.Optimizer, data: Any, blocking: bool = True
) -> SaveHandle | None:
    """The save of one shard group (the whole mesh without HSDP)."""
    ranks = sharded.ranks
    snapshot = checkpoint.Snapshot(
        optimizer=optimizer_name(type(optimizer)),
        step=_step(optimizer),
        shard_gradients=True,
        names=sharded.names,
        specs=sharded.specs,
        plan=plan_dim0_shards(sharded.specs, sharded.group_of, shard_size=ranks.world_size),
        param_groups=sharded.groups,
        pieces=[
            piece
            for index, (name, param) in enumerate(zip(sharded.names, sharded.params, strict=True))
            if (state := optimizer.state.get(param))
            and (piece := _piece(index, name, param, state)) is not None
        ],
        model=sharded.model,
        data=data_extra(data),
    )
    named = list(sharded.model.named_parameters())
    weights = _gather_weights(named, checkpoint.weight_owners_of(snapshot), ranks.rank)
    return checkpoint.save(path, snapshot._replace(weights=weights), ranks, blocking=blocking)


def load_param_shards(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    data: Any = None,
    allow_nonfinite: bool = False,
    allow_dtype_conversion: bool = False,
) -> None:
    """Load a checkpoint written at any world size by any gradsync saver (ZeRO-3, ZeRO-1/2,
    a plain optimizer's, JAX) into a ``fully_shard``-ed ``model`` and its ``optimizer``
    (a collective over the model's mesh); on any error every rank raises and nothing changes.

    Each rank reads only its rows of every parameter's state from the files (the weights,
    when stored, are read whole and cut) and keeps them as ``DTensor``s of the parameter's
    spec, through the optimizer's own ``load_state_dict``; the saved hyper-parameters come
    back too (from a torch checkpoint).
    Every check of ``ZeroRedundancyOptimizer.load`` runs first, on every rank.

    Args:
        allow_nonfinite: take NaN or inf in state tensors and weights as they are.
        allow_dtype_conversion: cast state stored in another dtype to the parameter's.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different
            (``CheckpointError`` on every rank).

    Example:
        >>> load_param_shards("ckpt/step100", model, optimizer)  # doctest: +SKIP
    """
    sharded = _Sharded(model, optimizer)
    target = checkpoint.LoadTarget(
        optimizer_class=type(optimizer),
        names=sharded.names,
        specs=sharded.specs,
        param_groups=sharded.groups,
        shapes=[tuple(p.shape) for p in sharded.params],
        needed=set(range(len(sharded.params))),  # every rank holds rows of each parameter
        model=sharded.model,
        policy=checkpoint.ValuePolicy(allow_nonfinite, allow_dtype_conversion),
        windows={i: held_elements(p) for i, p in enumerate(sharded.params)},  # its rows only
    )
    what = f"cannot load checkpoint {os.fspath(path)} (HSDP: a replica refused it)"
    loaded = _across_replicas(sharded, lambda: checkpoint.load(path, target, sharded.ranks), what)
    restore_data(loaded.extra or {}, data, os.fspath(path))  # every rank alike: one manifest

    def rows(index: int, state: dict[str, Any]) -> dict[str, Any]:
        like = sharded.params[index]
        return {
            k: as_row_sharded(v, like) if torch.is_tensor(v) and v.dim() >= 1 else v
            for k, v in state.items()
        }

    copy_weights(sharded.model, loaded.model)
    optimizer.load_state_dict(loaded_state_dict(loaded, rows))


# The names before the executors shared one pair (gradsync_jax's): deprecated, warn once.
save_fully_sharded = deprecated_alias(save_param_shards, "save_fully_sharded")
load_fully_sharded = deprecated_alias(load_param_shards, "load_fully_sharded")
