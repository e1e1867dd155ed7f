"""The torch side of the torch/JAX parity test: an MLP trained by gradsync_torch.DataParallel.

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import torch
from torch import nn

# torch state key -> the Optax field the JAX side compares it with (the test's own copy:
# this torch process does not import gradsync_jax).
TORCH_TO_OPTAX_STATE = {
    "exp_avg": "mu",
    "exp_avg_sq": "nu",
    "step": "count",
    "momentum_buffer": "trace",
}

# 12 Linear layers: Flax names them Dense_0..Dense_11, and Dense_10 sorts before Dense_2, so
# every parity test catches an ordering bug between the frameworks.
WIDTHS = [10] + [16] * 11 + [4]
RENAMES = {f"Dense_{i}": f"layers.{i}" for i in range(len(WIDTHS) - 1)}


class TorchMLP(nn.Module):
    """``layers.i`` Linear layers with tanh between: the twin of the Flax MLPs in the test."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def train(
    rank: int,
    world_size: int,
    widths: list[int],
    init: dict[str, np.ndarray],
    x: np.ndarray,
    y: np.ndarray,
    optimizers: dict[str, dict[str, Any]],
    steps: int,
) -> dict[str, Any]:
    """Train one model per optimizer on this rank's half of the batch; return rank's result.

    Returns:
        ``{"fingerprint": initial plan fingerprint, "<opt>": {"params": {...},
        "state": {"<param>/<optax key>": array}}}``.
    """
    from gradsync_torch import DataParallel

    xs = torch.from_numpy(x).chunk(world_size)[rank]
    ys = torch.from_numpy(y).chunk(world_size)[rank]
    out: dict[str, Any] = {}
    for opt_name, hyper in optimizers.items():
        model = TorchMLP(widths)
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
        dp = DataParallel(model)
        out["fingerprint"] = dp.bucket_plan.fingerprint
        if opt_name == "sgd":
            opt: torch.optim.Optimizer = torch.optim.SGD(dp.parameters(), lr=hyper["lr"])
        else:
            opt = torch.optim.Adam(
                dp.parameters(), lr=hyper["lr"], betas=hyper["betas"], eps=hyper["eps"]
            )
        for _ in range(steps):
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(dp(xs), ys)
            loss.backward()
            opt.step()
        names = {id(p): n for n, p in model.named_parameters()}
        state = {
            f"{names[id(p)]}/{TORCH_TO_OPTAX_STATE[key]}": value.numpy().copy()
            for p, entries in opt.state.items()
            for key, value in entries.items()
            if key != "step"
        }
        params = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
        out[opt_name] = {"params": params, "state": state}
    return out
