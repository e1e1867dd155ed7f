"""A plain ``torch.optim`` optimizer saved as a gradsync checkpoint (docs/interchange.md).

The reverse of ``load_optimizer_state_dict``: one process, no process group, a one-rank
checkpoint (greedy plan, world size 1) with the model's weights, written by the same save as
``ZeroRedundancyOptimizer.save``, so either framework loads it at any world size.
``import_dcp`` ends with it.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from gradsync_core import SaveHandle, plan_greedy_shards
from gradsync_torch._optim_state import (
    RankGroup,
    StatePiece,
    optimizer_name,
    param_specs_of,
    parameter_names,
)
from gradsync_torch.checkpoint import zero as checkpoint


def save_plain(
    path: str | os.PathLike[str],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    blocking: bool = True,
) -> SaveHandle | None:
    """Save a plain ``torch.optim`` optimizer of ``model`` and its weights as a one-rank
    gradsync checkpoint (greedy plan, world size 1), without a process group; the manifest's
    step is the largest ``step`` in the optimizer's state (0 before the first step). With
    ``blocking=False``, returns a ``SaveHandle`` once the state and weights are staged, as
    ``ZeroRedundancyOptimizer.save`` does.

    Raises:
        ValueError: if a parameter of ``optimizer`` is not one of ``model``'s, or the save
            fails (``CheckpointError``; the previous checkpoint at ``path`` is kept).

    Example:
        >>> save_plain("ckpt", net, torch.optim.AdamW(net.parameters()))  # doctest: +SKIP
    """
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    names = parameter_names(groups, model)
    specs = param_specs_of(names, params, set(), plans_owners=False)
    per_group, start = [], 0
    for group in groups:  # torch's greedy partition per param group, here over one rank
        per_group.append(specs[start : start + len(group["params"])])
        start += len(group["params"])
    plan = plan_greedy_shards(per_group, world_size=1)
    pieces = [
        StatePiece(i, 0, p.numel(), True, optimizer.state[p])
        for i, p in enumerate(params)
        if optimizer.state.get(p)
    ]
    steps = [_step(piece.state.get("step")) for piece in pieces]
    snapshot = checkpoint.Snapshot(
        optimizer=optimizer_name(type(optimizer)),
        step=max(steps, default=0),
        shard_gradients=False,
        names=names,
        specs=specs,
        plan=plan,
        param_groups=groups,
        pieces=pieces,
        model=model,
    )
    alone = RankGroup(process_group=None, rank=0, world_size=1)
    return checkpoint.save(path, snapshot, alone, blocking=blocking)


def _step(value: Any) -> int:
    """A state's ``step`` (a 0-d tensor or a number) as the manifest's int; 0 if absent."""
    if value is None:
        return 0
    return int(value.item() if torch.is_tensor(value) else value)
