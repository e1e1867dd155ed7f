"""``TiedLM`` under ``fully_shard`` (ZeRO-3): the model, its units, its AdamW, its training on
one 24-token batch split over the ranks, its state in model space and the uninterrupted
single-process reference; shared by tests/torch/test_fully_shard_checkpoint.py and (the torch
side, ``save_zero3``) test_cross_param_shards.py.

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import nn

from tests.parity.tied_worker import DEPTH, TiedLM

HYPER = {"lr": 1e-2, "betas": (0.5, 0.75), "eps": 1e-8, "weight_decay": 0.1}
KEYS = ("exp_avg", "exp_avg_sq")


def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A seeded ``TiedLM`` under ``fully_shard`` (each layer, the frozen layer, then the root)
    and its AdamW."""
    from gradsync_torch import fully_shard

    torch.manual_seed(seed)  # 0: the runs' start; another seed shows a load that skips weights
    model = TiedLM()
    for i in range(DEPTH):
        fully_shard(model.layers[i])
    fully_shard(model.frozen)
    fully_shard(model)  # the root: the embedding and the head tied to it
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def train(model, opt, tokens, labels, steps: int, rank: int, world_size: int) -> None:
    """``steps`` optimizer steps on this rank's chunk of the batch."""
    xs = torch.from_numpy(tokens).chunk(world_size)[rank]
    ys = torch.from_numpy(labels).chunk(world_size)[rank]
    for _ in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(xs), ys).backward()
        opt.step()


def whole(value: Any) -> np.ndarray:
    """A tensor, or a DTensor gathered whole (a collective), as a NumPy copy."""
    value = value.full_tensor() if hasattr(value, "full_tensor") else value  # a collective
    return value.detach().numpy().copy()


def state_of(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Parameters, moments and steps in model space (sharded ones gathered, on every rank)."""
    out: dict[str, Any] = {"params": {}, "state": {}, "steps": {}}
    for name, p in model.named_parameters():
        out["params"][name] = whole(p)
        state = opt.state.get(p, {})
        for key in KEYS:
            if key in state:
                out["state"][f"{name}/{key}"] = whole(state[key])
        if "step" in state:
            out["steps"][name] = float(state["step"])
    return out


def reference(tokens, labels, steps: int) -> dict[str, Any]:
    """The run that never stopped, in one process on the whole batch."""
    torch.manual_seed(0)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    train(model, opt, tokens, labels, steps, 0, 1)
    return state_of(model, opt)


def save_zero3(
    rank: int, world_size: int, tokens: np.ndarray, labels: np.ndarray, path: str, steps: int
) -> dict[str, Any]:
    """Train ``TiedLM`` under ``fully_shard`` for ``steps`` steps at ``world_size`` ranks and
    save it (``save_param_shards``). Returns (rank 0) the state saved, in model space, and
    the plan's fingerprint and JSON (the root's ``shard_plan``)."""
    from gradsync_torch.checkpoint.param_shards import save_param_shards

    model, opt = sharded(0)
    train(model, opt, tokens, labels, steps, rank, world_size)
    save_param_shards(path, model, opt)
    saved = state_of(model, opt)  # a collective: every rank gathers
    if rank != 0:
        return {}
    plan = model.shard_plan
    return {**saved, "fingerprint": plan.fingerprint, "plan": plan.to_json()}
