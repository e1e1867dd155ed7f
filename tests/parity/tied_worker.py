"""The torch side of the tied-embedding, frozen-layer continuation test (spawned gloo workers).

Imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

VOCAB, DIM, DEPTH = 11, 8, 3


class TiedLM(nn.Module):
    """Embedding -> frozen Linear -> ``DEPTH`` Linear layers -> the embedding as output
    projection (``head.weight`` is ``embed.weight``): the twin of the Flax model that calls
    ``Embed.attend``."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.layers = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(DEPTH))
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.embed(tokens)))
        for layer in self.layers:
            h = torch.tanh(layer(h))
        return self.head(h)


def run(
    rank: int,
    world_size: int,
    init: dict[str, np.ndarray] | None,
    tokens: np.ndarray,
    labels: np.ndarray,
    hyper: dict[str, Any],
    steps: int,
    save_at: int | None,
    save_to: str | None,
    load_from: str | None,
) -> dict[str, Any]:
    """Train ``steps`` AdamW steps (DataParallel + ZeroRedundancyOptimizer) from ``init``, or
    from the weights and state of ``load_from``; save with the weights after ``save_at``.

    Returns:
        rank 0: ``{"params", "state": {"<name>/<key>": array}, "steps"}``; others ``{}``.
    """
    from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

    torch.manual_seed(1234)  # a start unlike ``init``: a load that skipped weights would show
    model = TiedLM()
    if init is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.from_numpy(init[name]))
    dp = DataParallel(model)
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.AdamW, **hyper)
    if load_from is not None:
        opt.load(load_from, model=model)
    xs = torch.from_numpy(tokens).chunk(world_size)[rank]
    ys = torch.from_numpy(labels).chunk(world_size)[rank]
    for step in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(dp(xs), ys).backward()
        opt.step()
        if step + 1 == save_at:
            opt.save(save_to, model=model)
    opt.consolidate_state_dict(to=0)
    if rank != 0:
        return {}
    names = [name for name, _ in model.named_parameters()]
    state = opt.state_dict()["state"]
    return {
        "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        "state": {
            f"{names[i]}/{key}": value.numpy().copy()
            for i, entries in state.items()
            for key, value in entries.items()
            if torch.is_tensor(value) and value.dim() > 0
        },
        "steps": {names[i]: float(entries["step"]) for i, entries in state.items()},
    }
