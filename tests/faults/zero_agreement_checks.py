"""Checks run inside 2 spawned gloo ranks by ``test_zero_agreement.py``: ranks whose
ZeroRedundancyOptimizer settings differ get one sentence on every rank naming the param group,
the key and both values (issue 21 item 5; docs/design.md §15).

Each owner steps its shard with its own optimizer, so a rank with another lr, class or
weight_decay used to diverge silently while the save recorded rank 0's settings. After each
expected error the ranks have issued the same collectives, so one process group serves every
check in turn. No tests of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from gradsync_torch import ZeroRedundancyOptimizer
from tests.torch.dp_grad_checks import expect_error


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _groups(model: nn.Module, decay: float = 0.0) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": decay},
    ]


def check_optimizer_settings_agree(rank: int, ws: int) -> None:
    """Per-rank lr, Adam vs AdamW, one group's weight_decay: refused at construction."""
    odd = rank == ws - 1
    cases: list[tuple[list[str], Callable[[], object]]] = [
        (
            ["ranks 0 and 1", "param group 0: lr 0.01 vs 0.1"],
            lambda: ZeroRedundancyOptimizer(
                _model().parameters(), torch.optim.Adam, lr=0.1 if odd else 1e-2
            ),
        ),
        (
            ["optimizer torch.optim.Adam vs torch.optim.AdamW"],
            lambda: ZeroRedundancyOptimizer(
                _model().parameters(), torch.optim.AdamW if odd else torch.optim.Adam, lr=1e-2
            ),
        ),
        (
            ["param group 1: weight_decay 0.0 vs 0.5"],
            lambda: ZeroRedundancyOptimizer(
                _groups(_model(), 0.5 if odd else 0.0), torch.optim.Adam, lr=1e-2
            ),
        ),
        (
            ["param group 1: weight_decay 0.0 vs 0.5"],
            lambda: ZeroRedundancyOptimizer(
                _groups(_model(), 0.5 if odd else 0.0),
                torch.optim.Adam,
                lr=1e-2,
                shard_gradients=True,
            ),
        ),
    ]
    for needles, build in cases:
        expect_error(ValueError, needles, build)
    ZeroRedundancyOptimizer(_model().parameters(), torch.optim.Adam, lr=1e-2)  # still in step


def check_add_param_group_agrees(rank: int, ws: int) -> None:
    """An added group with a per-rank lr is refused on every rank."""
    model = _model()
    named = list(model.named_parameters())
    opt = ZeroRedundancyOptimizer([p for _, p in named[:2]], torch.optim.Adam, lr=1e-2)
    lr = 0.5 if rank == ws - 1 else 0.25
    expect_error(
        ValueError,
        ["param group 1: lr 0.25 vs 0.5"],
        lambda: opt.add_param_group({"params": [p for _, p in named[2:]], "lr": lr}),
    )


def check_load_state_dict_agrees(rank: int, ws: int) -> None:
    """A torch-format state dict with a per-rank lr is refused before any state changes."""
    opt = ZeroRedundancyOptimizer(_model().parameters(), torch.optim.Adam, lr=1e-2)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    box = [state]
    torch.distributed.broadcast_object_list(box, src=0)
    state = box[0]
    if rank == ws - 1:
        state["param_groups"][0]["lr"] = 0.5
    expect_error(ValueError, ["param group 0: lr 0.01 vs 0.5"], lambda: opt.load_state_dict(state))
    assert opt.param_groups[0]["lr"] == 1e-2, "a refused load changed the lr"


CHECKS: dict[str, Callable[[int, int], None]] = {
    "optimizer_settings_agree": check_optimizer_settings_agree,
    "add_param_group_agrees": check_add_param_group_agrees,
    "load_state_dict_agrees": check_load_state_dict_agrees,
}
