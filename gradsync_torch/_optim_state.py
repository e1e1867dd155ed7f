"""The optimizer state every torch saver and loader shares, in model space.

Pieces in model space, the group they are sharded over, names and specs of an optimizer's
parameters.

``StatePiece`` is a piece of one parameter's state: the whole parameter's (ZeRO-1, a plain
optimizer) or that of elements ``[start, stop)`` of the flattened parameter (ZeRO-2, ZeRO-3
rows); ``assemble`` joins pieces into per-parameter state. ZeRO (``zero/``) and the
checkpoints (``checkpoint/``) both build on these, so they live below both.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch
from torch import nn

from gradsync_core import ParamSpec
from gradsync_core.checkpoint import unwrapped_names
from gradsync_torch._specs import dtype_name, is_expert, unwrapped

# Param-group keys that are not hyper-parameters.
NOT_HYPER = ("params", "param_names")


class StatePiece(NamedTuple):
    """A piece of one parameter's optimizer state in model space."""

    index: int  # type: ignore[assignment]  # the global parameter index (param groups flattened,
    # as torch's state_dict); the field shadows tuple.index, as a NamedTuple field may
    start: int  # element range of the flattened parameter
    stop: int
    whole: bool  # the state of the whole parameter, tensors in its shape
    state: dict[str, Any]


class RankGroup(NamedTuple):
    """The data-parallel group the optimizer shards over, and this rank's place in it."""

    process_group: Any  # None: the world
    rank: int  # group rank
    world_size: int


def hyper_parameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's hyper-parameters (lr, betas, ...), without its parameters."""
    return {k: v for k, v in group.items() if k not in NOT_HYPER}


def check_same_param_groups(
    loaded: Sequence[Mapping[str, Any]], own: Sequence[Mapping[str, Any]]
) -> None:
    """Refuse a loaded state dict whose param groups hold other numbers of parameters.

    Raises:
        ValueError: the sizes differ.
    """
    if [len(g["params"]) for g in loaded] != [len(g["params"]) for g in own]:
        raise ValueError(
            "loaded state dict has param groups of sizes "
            f"{[len(g['params']) for g in loaded]}, this optimizer "
            f"{[len(g['params']) for g in own]}; load the state of the same parameters"
        )


def optimizer_name(optimizer_class: type) -> str:
    """``torch.optim.Adam`` for torch's optimizers (their public path), else module.qualname."""
    if getattr(torch.optim, optimizer_class.__name__, None) is optimizer_class:
        return f"torch.optim.{optimizer_class.__name__}"
    return f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"


class OwnsShardedState:
    """Marks an optimizer that keeps only its rank's share of the state and saves and loads
    it itself (``ZeroRedundancyOptimizer``): the checkpoint functions for plain optimizers
    refuse it with a sentence that points to its own ``save`` / ``load``."""


def assemble(pieces: Sequence[StatePiece], shapes: Sequence[tuple[int, ...]]) -> dict[int, Any]:
    """Per-parameter state from pieces: whole ones as they are; flat slices concatenated in
    element order and reshaped to the parameter (0-d entries taken from the first slice).

    Raises:
        ValueError: if the slices of a parameter do not cover it exactly once.
    """
    by_index: dict[int, list[StatePiece]] = defaultdict(list)
    for piece in pieces:
        by_index[piece.index].append(piece)
    full: dict[int, Any] = {}
    for index, parts in by_index.items():
        if len(parts) == 1 and parts[0].whole:
            full[index] = parts[0].state
            continue
        parts.sort(key=lambda part: part.start)
        numel, cursor = math.prod(shapes[index]), 0
        for part in parts:
            if part.start != cursor:
                break
            cursor = part.stop
        if cursor != numel:
            raise ValueError(
                f"the state slices of parameter #{index} cover elements up to {cursor} of "
                f"{numel} without a gap or overlap: the pieces put together (gathered from the "
                "ranks, or read from a checkpoint's rank files) do not tile the parameter"
            )
        state = {}
        for key, first in parts[0].state.items():
            if torch.is_tensor(first) and first.dim() >= 1:
                joined = torch.cat([part.state[key].reshape(-1) for part in parts])
                state[key] = joined.view(shapes[index])
            else:
                state[key] = first
        full[index] = state
    return full


def parameter_names(
    param_groups: Sequence[dict[str, Any]], model: nn.Module | None = None
) -> list[str]:
    """One name per parameter of ``param_groups`` (global index order): the names given
    with ``named_parameters()``, else looked up in ``model``.

    Raises:
        ValueError: if neither is available, or ``model`` lacks a parameter.
    """
    if all("param_names" in g for g in param_groups):
        names = [n for group in param_groups for n in group["param_names"]]
        # A wrapper's named_parameters() (DDP's, DataParallel's): store the model's own names,
        # the ones the model given has inside its wrappers (a child may be called "module").
        bare = unwrapped_names(names)
        if model is None:
            return bare
        inner = {name for name, _ in unwrapped(model).named_parameters()}
        return names if set(names) <= inner or not set(bare) <= inner else bare
    if model is None:
        raise ValueError(
            "this optimizer has no parameter names: build it from "
            "model.named_parameters() or pass model=<the module> to save/load"
        )
    params = [p for group in param_groups for p in group["params"]]
    by_id = {id(p): name for name, p in unwrapped(model).named_parameters()}
    names = [by_id.get(id(p)) for p in params]
    if None in names:
        i = names.index(None)
        raise ValueError(
            f"parameter #{i} ({tuple(params[i].shape)}) is not a parameter of the "
            "given model; pass the model this optimizer trains"
        )
    return names


def param_specs_of(
    names: Sequence[str],
    params: Sequence[torch.Tensor],
    planned: set[int],
    *,
    plans_owners: bool = True,
) -> list[ParamSpec]:
    """The specs the plans are made of; ``planned`` are the indices planned before.

    ``plans_owners=False``: the optimizer plans no owners over a group (a plain optimizer's
    checkpoint, one process), so experts and dense parameters may share it.

    Raises:
        ValueError: if expert parameters (declared split over ``"ep"`` by their layer, e.g.
            ``ExpertMLPs``: ``is_expert``) and dense ones share an optimizer that plans owners:
            they must be planned over different groups (``edp`` and ``dp``, docs/design.md §6).
    """
    specs = [
        ParamSpec(
            name=name,
            shape=tuple(p.shape),
            dtype=dtype_name(p.dtype),
            # Once planned, a parameter keeps its owner (and state) when frozen again.
            requires_grad=p.requires_grad or i in planned,
            device=p.device.type,
            expert=is_expert(p),
        )
        for i, (name, p) in enumerate(zip(names, params, strict=True))
    ]
    experts = [s.name for s in specs if s.expert]
    if plans_owners and experts and len(experts) < len(specs):
        dense = next(s.name for s in specs if not s.expert)
        raise ValueError(
            f"this optimizer holds expert parameters ({experts[0]!r}, ...) and dense ones "
            f"({dense!r}, ...): a ZeroRedundancyOptimizer plans owners over one group, but "
            "expert weights are replicated over edp and dense ones over dp; build two, "
            "dense over groups['dp'].process_group and experts over groups['edp'].process_group"
        )
    return specs
