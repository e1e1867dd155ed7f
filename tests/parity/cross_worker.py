"""The torch side of the cross-framework checkpoint tests: ZeRO training that saves or resumes.

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from tests.parity.torch_worker import TorchMLP

OPTIMIZERS = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}


def run(
    rank: int,
    world_size: int,
    widths: list[int],
    init: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    optimizer: str,
    hyper: dict[str, Any],
    steps: int,
    save_at: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
) -> dict[str, Any]:
    """Train ``steps`` steps of DataParallel + ZeroRedundancyOptimizer on this rank's part of
    the batch, after loading ``load_from`` if given; save to ``save_to`` after ``save_at``.

    Returns:
        rank 0: ``{"saved_params", "params", "state": {"<name>/<torch key>": array}}`` (the
        state consolidated), other ranks ``{}``.
    """
    from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

    xs = torch.from_numpy(x).chunk(world_size)[rank]
    ys = torch.from_numpy(y).chunk(world_size)[rank]
    model = TorchMLP(widths)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    dp = DataParallel(model)
    opt = ZeroRedundancyOptimizer(model.named_parameters(), OPTIMIZERS[optimizer], **hyper)
    if load_from is not None:
        opt.load(load_from)
    out: dict[str, Any] = {}
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(dp(xs), ys).backward()
        opt.step()
        if step + 1 == save_at:
            opt.save(save_to)
            out["saved_params"] = {
                n: p.detach().numpy().copy() for n, p in model.named_parameters()
            }
    opt.consolidate_state_dict(to=0)
    if rank != 0:
        return {}
    names = [n for n, _ in model.named_parameters()]
    state = opt.state_dict()["state"]
    out["params"] = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    out["state"] = {
        f"{names[i]}/{key}": value.numpy().copy()
        for i, entries in state.items()
        for key, value in entries.items()
        if torch.is_tensor(value) and value.dim() > 0
    }
    out["steps"] = {
        f"{names[i]}": float(entries["step"]) for i, entries in state.items() if "step" in entries
    }
    return out
