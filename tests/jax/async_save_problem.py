"""What the JAX tests of saves in the background share (test_async_save.py and
tests/faults/test_async_jax_faults.py): a JAX Adam checkpoint read back in a plain torch Adam
at world size 1, and the same moments from the Optax state, by ``"<name>/<key>"``."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from gradsync_jax import to_torch_state
from gradsync_torch import load_optimizer_state_dict


def torch_twin() -> nn.Module:
    class Twin(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense, self.head = nn.Linear(6, 10), nn.Linear(10, 3)

    return Twin()


def torch_moments(path: str) -> dict[str, np.ndarray]:
    """The checkpoint in a plain torch Adam at world size 1, by ``"<name>/<key>"``."""
    model = torch_twin()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)  # the JAX save's hyper-parameters
    state = load_optimizer_state_dict(path, opt, model)
    names = [n for n, _ in model.named_parameters()]
    return {
        f"{names[i]}/{key}": s[key].numpy()
        for i, s in state["state"].items()
        for key in ("exp_avg", "exp_avg_sq")
    }


def optax_moments(adam: Any) -> dict[str, np.ndarray]:
    out = {}
    for key, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        out |= {f"{name}/{key}": np.asarray(v) for name, v in to_torch_state(tree).items()}
    return out
