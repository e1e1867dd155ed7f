"""A gradsync checkpoint into a plain torch optimizer (docs/checkpoints.md).

``ZeroRedundancyOptimizer.load`` reads a checkpoint into sharded state; this reads it, in one
process, into an ordinary ``torch.optim`` optimizer (``torch.optim.AdamW(model.parameters())``)
through its own ``load_state_dict``, so a run trained with gradsync in JAX (or with ZeRO in
torch) can continue, be evaluated or fine-tuned without gradsync's executors.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from gradsync_torch._optim_state import (
    OwnsShardedState,
    RankGroup,
    hyper_parameters,
    param_specs_of,
    parameter_names,
)
from gradsync_torch.checkpoint import zero as checkpoint


def load_optimizer_state_dict(
    path: str | os.PathLike[str], optimizer: torch.optim.Optimizer, model: nn.Module
) -> dict[str, Any]:
    """Load a gradsync checkpoint, written by torch or JAX at any world size, into a plain
    torch optimizer of ``model``'s parameters, and return the ``state_dict`` it loaded.

    Every check ``ZeroRedundancyOptimizer.load`` makes comes first (file hashes, parameter
    names, shapes and dtypes, the optimizer's class or its Optax counterpart, every state key
    the optimizer needs); on any error the optimizer is unchanged. A torch checkpoint also
    restores the saved hyper-parameters; a JAX one keeps the optimizer's own (Optax keeps
    them in the transformation, not the state). Model weights, if stored, are not touched:
    load them with ``load_model_weights``.

    Args:
        path: the checkpoint directory.
        optimizer: a ``torch.optim`` optimizer (not a ``ZeroRedundancyOptimizer``: use its
            ``load``) whose parameters all belong to ``model``.
        model: the module the optimizer trains; gives the parameters their checkpoint names.

    Returns:
        The ``state_dict`` given to ``optimizer.load_state_dict``.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different.

    Example:
        >>> opt = torch.optim.AdamW(net.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> load_optimizer_state_dict("ckpt", opt, net)  # doctest: +SKIP
    """
    if isinstance(optimizer, OwnsShardedState):
        raise ValueError(
            "load_optimizer_state_dict is for plain torch optimizers and was given a "
            f"{type(optimizer).__name__}, which keeps its state sharded; call its "
            "load(path, model=...) on every rank instead"
        )
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    if any(isinstance(p, DTensor) for p in params):
        raise ValueError(
            "load_optimizer_state_dict is for unsharded parameters and this optimizer's are "
            "DTensors (a fully_shard-ed model); call load_param_shards(path, model, optimizer) "
            "on every rank instead"
        )
    names = parameter_names(groups, model)
    target = checkpoint.LoadTarget(
        optimizer_class=type(optimizer),
        names=names,
        specs=param_specs_of(names, params, set(), plans_owners=False),
        param_groups=groups,
        shapes=[tuple(p.shape) for p in params],
        needed=set(range(len(params))),
    )
    loaded = checkpoint.load(path, target, RankGroup(process_group=None, rank=0, world_size=1))
    state_dict = loaded_state_dict(loaded)
    optimizer.load_state_dict(state_dict)
    return state_dict


def loaded_state_dict(
    loaded: checkpoint.Loaded,
    state_of: Callable[[int, dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """A checked checkpoint as the ``state_dict`` its torch optimizer loads: each
    parameter's model-space state (through ``state_of(index, state)`` when given: ZeRO-3 cuts
    it to this rank's rows) by global index, and the saved hyper-parameters per group."""
    state = {i: s if state_of is None else state_of(i, s) for i, s in sorted(loaded.state.items())}
    state_dict: dict[str, Any] = {"state": state, "param_groups": []}
    first = 0
    for group in loaded.param_groups:
        count = len(group["params"])
        indices = list(range(first, first + count))
        state_dict["param_groups"].append({**hyper_parameters(group), "params": indices})
        first += count
    return state_dict
