"""What a torch Distributed Checkpoint user has: a model with a tied weight (``head.weight`` is
``embed.weight``) and a frozen layer, and the load recipe docs/interchange.md gives (plain DCP,
no gradsync). Shared by test_dcp_interchange.py (and its ``--model`` builder script) and
tests/jax/test_orbax_interchange.py.
"""

from __future__ import annotations

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


class Tied(nn.Module):
    """An embedding, a frozen layer, a layer and a head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.frozen = nn.Linear(6, 6)
        self.frozen.requires_grad_(False)
        self.layer = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.layer(torch.tanh(self.frozen(self.embed(tokens))))))


def make(seed: int = 0) -> tuple[Tied, torch.optim.AdamW]:
    """A seeded ``Tied`` and its AdamW (no state yet)."""
    torch.manual_seed(seed)
    model = Tied()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.5, 0.75))


def user_load_into(path, model: nn.Module, opt: torch.optim.Optimizer):
    """The recipe docs/interchange.md gives: plain DCP, no gradsync."""
    model_sd, optim_sd = get_state_dict(model, opt)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return model, opt
