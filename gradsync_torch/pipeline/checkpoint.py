"""A pipeline's checkpoint: the usual gradsync format, in model space (docs/pipeline.md).

The stages' weights and optimizer state are written under the model's own names, whole, as
one model: the checkpoint a plain ``torch.optim`` optimizer of the unpipelined model writes
(``save_plain``), so it loads at any pipeline size, any data parallelism, with or without
ZeRO-3, into the unpipelined model (``load_model_weights``, ``load_optimizer_state_dict``)
and in JAX (``gradsync_jax.load_params``). A weight tied across two stages is stored once,
under the first stage's name, as the unpipelined model lists it.

Saving gathers the first pipeline group's stages (gathered from their ``fully_shard``
shards first) on rank 0, which writes (with ``blocking=False`` in a background thread, the
gathered copies serving as the save's staging); loading reads the weights on every rank and
takes its stages' names (and, with ZeRO-3, its rows). Both are collectives over the world,
and a problem on any rank is raised on every rank before anything changes.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync_core import Manifest, SaveHandle, read_manifest, wait_for_saves
from gradsync_core.checkpoint import resolve_checkpoint, start_agreed_save
from gradsync_torch._specs import unwrapped
from gradsync_torch.agreement import agree_ok
from gradsync_torch.checkpoint import zero as checkpoint
from gradsync_torch.checkpoint.model_state import read_weights
from gradsync_torch.checkpoint.plain import loaded_state_dict
from gradsync_torch.checkpoint.plain_save import save_plain
from gradsync_torch.checkpoint.save_agreement import RankSaveAgreement, background_ranks
from gradsync_torch.param_sharding._rows import as_row_sharded, local_rows
from gradsync_torch.pipeline.runtime import Pipeline
from gradsync_torch.zero.state import RankGroup, hyper_parameters


def _whole(value: Any) -> Any:
    """A tensor (a ``fully_shard`` shard gathered: collective) on the CPU; others as they are."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return value.detach().cpu().clone() if torch.is_tensor(value) else value


def _model_space(pipe: Pipeline, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """This rank's stages as ``(stage, [(name, weight, state, group)])`` and its groups."""
    group_of = {id(p): g for g, group in enumerate(optimizer.param_groups) for p in group["params"]}
    stages = []
    for index, module in sorted(pipe.stages.items()):
        rows = []
        for name, p in unwrapped(module).named_parameters():
            state = {k: _whole(v) for k, v in optimizer.state.get(p, {}).items()}
            rows.append((name, _whole(p), state, group_of.get(id(p))))
        stages.append((index, rows))
    groups = [hyper_parameters(g) for g in optimizer.param_groups]
    return {"stages": stages, "groups": groups}


def _check_local(pipe: Pipeline, optimizer: Any) -> str | None:
    topology = pipe.plan.topology
    if topology.tp * topology.cp != 1:
        return (
            f"the stages are split over tp = {topology.tp}, cp = {topology.cp}; a pipeline "
            "checkpoint in model space needs whole weights, so save tensor-parallel stages "
            "with their own checkpoint"
        )
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        return f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
    return None


@overload
def save_pipeline(
    path: str | os.PathLike[str],
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    *,
    blocking: Literal[True] = True,
) -> None: ...


@overload
def save_pipeline(
    path: str | os.PathLike[str],
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    *,
    blocking: Literal[False],
) -> SaveHandle: ...


def save_pipeline(
    path: str | os.PathLike[str],
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer,
    *,
    blocking: bool = True,
) -> SaveHandle | None:
    """Save the pipeline's weights and optimizer state as one model's (collective: every rank).

    Args:
        path: the checkpoint directory (written atomically: a failed save keeps the old one).
        pipe: the pipeline.
        optimizer: this rank's ``torch.optim`` optimizer of ``pipe.parameters()``, the same
            class and param groups (by position) on every rank.
        blocking: ``False``: return once rank 0 holds the gathered stages (the gather copies
            them, as a blocking save's does); rank 0 writes the file in a background thread
            and every rank's handle ends with the agreed outcome, over a gloo group of its
            own (``ZeroRedundancyOptimizer.save`` says how). At most one save is in flight.

    Returns:
        ``None``; with ``blocking=False`` a ``SaveHandle`` whose ``wait()`` returns the
        manifest, on every rank.

    Raises:
        ValueError: on every rank, naming the first problem (tensor-parallel stages, ranks
            whose param groups differ, a failed write; with ``blocking=False`` a failed write
            at ``wait()``, the next save or, unraised, at exit).

    Example:
        >>> save_pipeline("ckpt/step100", pipe, optimizer)  # doctest: +SKIP
    """
    wait_for_saves()  # the save in flight first, on every rank (its failure raised on all)
    group = pipe._check
    what = f"cannot save pipeline checkpoint {os.fspath(path)}"
    agree_ok(_check_local(pipe, optimizer), group, what=what)
    mine = _model_space(pipe, optimizer)  # every rank: ZeRO-3 gathers are collectives
    rank = dist.get_rank()
    writers = pipe.plan.topology.groups("pp")[0]  # one pipeline group holds the whole model
    gathered: list[Any] | None = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine if rank in writers else None, gathered, dst=0, group=group)

    def write() -> str | None:
        """Rank 0 writes the whole model's checkpoint; its failure, as one sentence."""
        if rank != 0:
            return None
        assert gathered is not None
        try:
            whole, opt = _assemble(gathered, pipe.tied, type(optimizer))
            save_plain(path, whole, opt)
        except Exception as e:  # every rank must hear it
            return str(e)
        return None

    if blocking:
        agree_ok(write(), group, what=what)
        return None
    ranks = background_ranks(RankGroup(group, dist.get_rank(group), dist.get_world_size(group)))
    agreement = RankSaveAgreement(ranks)

    def run() -> Manifest:
        agreement.all_ok(write(), what)
        return read_manifest(path, verify_files=False)  # written and switched: agreed above

    return start_agreed_save(path, run, what=what, who=agreement.who)


def _assemble(
    gathered: Sequence[Any],
    tied: Sequence[tuple[str, str]],
    optimizer_class: type[torch.optim.Optimizer],
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The whole model and its optimizer from every stage's rows, in stage order."""
    parts = [p for p in gathered if p is not None]
    groups = parts[0]["groups"]
    for part in parts[1:]:
        if part["groups"] != groups:
            raise ValueError(
                f"the ranks' optimizers have different param groups ({groups} and "
                f"{part['groups']}); give every rank's optimizer the same groups and settings"
            )
    seconds = {b for _, b in tied}  # stored once, under the first stage's name
    rows = sorted(
        (s, i, row) for part in parts for s, stage in part["stages"] for i, row in enumerate(stage)
    )
    kept = [row for _, _, row in rows if row[0] not in seconds]
    params = [(name, nn.Parameter(weight, requires_grad=True)) for name, weight, _, _ in kept]
    whole = _container(params)
    by_group: list[list[nn.Parameter]] = [[] for _ in groups]
    for (_, param), (_, _, _, g) in zip(params, kept, strict=True):
        if g is not None:
            by_group[g].append(param)
    make: Callable[..., torch.optim.Optimizer] = optimizer_class  # a subclass's signature
    opt = make([{**hyper, "params": ps} for hyper, ps in zip(groups, by_group, strict=True)])
    for (_, param), (_, _, state, _) in zip(params, kept, strict=True):
        if state:
            opt.state[param] = state
    return whole, opt


def _container(params: Sequence[tuple[str, nn.Parameter]]) -> nn.Module:
    """A module holding ``params`` under their dotted names, in order."""
    root = nn.Module()
    for name, param in params:
        *path, leaf = name.split(".")
        parent = root
        for part in path:
            child = parent._modules.get(part)
            if child is None:
                child = nn.Module()
                parent.add_module(part, child)
            parent = child
        parent.register_parameter(leaf, param)
    return root


def load_pipeline(
    path: str | os.PathLike[str],
    pipe: Pipeline,
    optimizer: torch.optim.Optimizer | None = None,
) -> Manifest:
    """Load a checkpoint in model space into the pipeline's stages (collective: every rank).

    The checkpoint may come from a pipeline of any size, the unpipelined model
    (``save_plain``, ``ZeroRedundancyOptimizer.save``) or JAX; every rank reads the weights,
    takes its stages' (a tied weight's later copy from the name it is stored under; under
    ZeRO-3 its rows) and, with ``optimizer``, its parameters' state and the saved
    hyper-parameters.

    Args:
        path: the checkpoint directory.
        pipe: the pipeline.
        optimizer: this rank's optimizer of ``pipe.parameters()``, with as many param groups
            as the saved one (weights only when ``None``).

    Returns:
        The checkpoint's manifest.

    Raises:
        ValueError: on every rank, naming the first problem (a missing or extra weight, a
            shape or dtype, another optimizer); no rank's stages or optimizer change then.

    Example:
        >>> load_pipeline("ckpt/step100", pipe, optimizer)  # doctest: +SKIP
    """
    group = pipe._check
    what = f"cannot load pipeline checkpoint {os.fspath(path)}"
    alias = {b: a for a, b in pipe.tied}
    mine = [
        (name, p)
        for _, module in sorted(pipe.stages.items())
        for name, p in unwrapped(module).named_parameters()
    ]
    names: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(names, [alias.get(n, n) for n, _ in mine], group=group)
    error, prepared = None, None
    try:
        problem = _check_local(pipe, optimizer)
        if problem is not None:
            raise ValueError(problem)
        version = resolve_checkpoint(path)
        manifest = read_manifest(version)
        weights = read_weights(version, manifest)
        _check_weights(weights, mine, alias, {n for held in names for n in held})
        state = (
            None if optimizer is None else _read_state(version, manifest, optimizer, mine, alias)
        )
        prepared = (manifest, weights, state)
    except Exception as e:  # every rank must hear it before any rank changes
        error = str(e)
    agree_ok(error, group, what=what)
    assert prepared is not None
    manifest, weights, state = prepared
    with torch.no_grad():
        for name, p in mine:
            weight = weights[alias.get(name, name)]
            if isinstance(p, DTensor):
                p.to_local().copy_(local_rows(weight, p))
            else:
                p.copy_(weight)
    if optimizer is not None:
        assert state is not None  # read whenever there is an optimizer
        optimizer.load_state_dict(state)
    return manifest


def _check_weights(
    weights: dict[str, torch.Tensor],
    mine: Sequence[tuple[str, nn.Parameter]],
    alias: dict[str, str],
    everyone: set[str],
) -> None:
    missing = sorted(everyone - set(weights))
    if missing:
        raise ValueError(f"the checkpoint has no weight {missing[0]!r}: another model?")
    extra = sorted(set(weights) - everyone)
    if extra:
        raise ValueError(
            f"the checkpoint has weight {extra[0]!r}, which no stage holds: another model?"
        )
    for name, p in mine:
        saved = weights[alias.get(name, name)]
        if (tuple(saved.shape), saved.dtype) != (tuple(p.shape), p.dtype):
            raise ValueError(
                f"weight {name!r} is {tuple(saved.shape)} {saved.dtype} in the checkpoint but "
                f"{tuple(p.shape)} {p.dtype} here: another model?"
            )


def _read_state(
    path: str,
    manifest: Manifest,
    optimizer: torch.optim.Optimizer,
    mine: Sequence[tuple[str, nn.Parameter]],
    alias: dict[str, str],
) -> dict[str, Any]:
    """This rank's optimizer ``state_dict`` from the checkpoint (checked, nothing loaded)."""
    name_of = {id(p): alias.get(n, n) for n, p in mine}
    names = [spec.name for spec in manifest.params]
    index = {n: i for i, n in enumerate(names)}
    saved_groups = [g["params"] for g in manifest.extra.get("param_groups", [])] or [names]
    if len(saved_groups) != len(optimizer.param_groups):
        raise ValueError(
            f"the checkpoint's optimizer has {len(saved_groups)} param group(s), this one "
            f"{len(optimizer.param_groups)}; build it with the same groups"
        )
    local: list[tuple[int, nn.Parameter, str]] = []
    for g, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            name = name_of.get(id(p))
            if name is None or name not in saved_groups[g]:
                raise ValueError(
                    f"parameter {name!r} of param group {g} is not in the checkpoint's group "
                    f"{g}; build the optimizer from pipe.parameters() with the saved groups"
                )
            local.append((g, p, name))
    target = checkpoint.LoadTarget(
        optimizer_class=type(optimizer),
        names=names,
        specs=list(manifest.params),
        param_groups=[
            {**hyper_parameters(group), "params": saved}
            for group, saved in zip(optimizer.param_groups, saved_groups, strict=True)
        ],
        shapes=[tuple(spec.shape) for spec in manifest.params],
        needed={index[name] for _, _, name in local},
    )
    loaded = checkpoint.load(path, target, RankGroup(process_group=None, rank=0, world_size=1))
    whole = loaded_state_dict(loaded)
    state = {}
    for i, (_, p, name) in enumerate(local):
        saved = whole["state"].get(index[name])
        if saved is not None:
            state[i] = {
                k: as_row_sharded(local_rows(v, p), p)
                if isinstance(p, DTensor) and torch.is_tensor(v) and v.dim() >= 1
                else v
                for k, v in saved.items()
            }
    groups = []
    for g, saved in enumerate(whole["param_groups"]):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        groups.append({**hyper, "params": [i for i, (gg, _, _) in enumerate(local) if gg == g]})
    return {"state": state, "param_groups": groups}
