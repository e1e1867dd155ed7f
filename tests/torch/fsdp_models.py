"""The ``fully_shard`` tests' model and what they compare on each rank.

``Net`` has uneven dim-0 sizes (11, 5, 4, 3, 1), a frozen parameter and a parameter of the root
module itself; ``UNITS`` are its nested units (test_param_shard_plan_fsdp.py,
test_fully_shard.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn


class Block(nn.Module):
    """A pre-norm residual MLP block."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, hidden)  # hidden = 1: a dim 0 smaller than the world
        self.out = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class Net(nn.Module):
    """Uneven dim-0 sizes (11, 5, 4, 3, 1), a frozen parameter, and a parameter of the root
    module itself (FSDP2 lists it after its children's)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.embed = nn.Embedding(11, 5)
        self.layers = nn.ModuleList([Block(5, 4), Block(5, 1)])  # 4 over 3 ranks: 2, 2, 0
        self.head = nn.Linear(5, 3)
        self.layers[1].ln.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.scale


UNITS = ["layers.0.fc", "layers.0", "layers.1"]  # nested: layers.0.fc inside layers.0


def local_shards(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter, gradient and optimizer state entry, by
    ``"param <name>"``, ``"grad <name>"`` and ``"<key> <name>"``."""
    out = {}
    for name, p in model.named_parameters():
        out[f"param {name}"] = p.to_local()
        if p.grad is not None:
            out[f"grad {name}"] = p.grad.to_local()
        for key, value in opt.state.get(p, {}).items():
            out[f"{key} {name}"] = value.to_local() if hasattr(value, "to_local") else value
    return out
