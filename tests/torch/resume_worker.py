"""Training whose data is drawn by ``ResumableSampler``: the torch side of the data-position
tests (tests/torch/test_resumable_sampler.py, tests/parity/test_data_position.py).

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsync_torch import ResumableSampler
from tests.parity.torch_worker import WIDTHS, TorchMLP

# A dataset of 100 samples read 24 per step (a multiple of 1, 2, 3 and 4 ranks): 4 steps an
# epoch with 4 samples left out each time (last_batch="drop"), so 10 steps cross two epochs.
SAMPLES, GLOBAL_BATCH, SEED = 100, 24, 1234
ADAMW = {"lr": 1e-2, "betas": (0.5, 0.75), "eps": 1e-8, "weight_decay": 0.1}


def dataset() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(7)
    x = rng.normal(size=(SAMPLES, WIDTHS[0])).astype(np.float32)
    return x, rng.normal(size=(SAMPLES, WIDTHS[-1])).astype(np.float32)


def train_steps(
    forward: Callable[[torch.Tensor], torch.Tensor],
    opt: torch.optim.Optimizer,
    sampler: ResumableSampler,
    steps: int,
) -> None:
    """``steps`` AdamW steps on the batches ``sampler`` draws, resuming mid-epoch if it is."""
    x, y = dataset()
    data = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)
    done = 0
    for epoch in itertools.count(sampler.epoch):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            opt.zero_grad()
            torch.nn.functional.mse_loss(forward(xb), yb).backward()
            opt.step()
            done += 1
            if done == steps:
                return


def reference(init: dict[str, np.ndarray], steps: int) -> tuple[torch.nn.Module, Any]:
    """One process, plain ``torch.optim.AdamW``, the whole global batch each step."""
    model = TorchMLP(WIDTHS)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    sampler = ResumableSampler(
        range(SAMPLES), num_replicas=1, rank=0, seed=SEED, global_batch_size=GLOBAL_BATCH
    )
    train_steps(model, opt, sampler, steps)
    return model, opt


def run(
    rank: int,
    world_size: int,
    init: dict[str, np.ndarray] | None,
    steps: int,
    save_to: str,
    load_from: str | None = None,
) -> None:
    """DataParallel + ZeroRedundancyOptimizer(AdamW) for ``steps`` steps on the sampler's
    data, after resuming weights, optimizer state and data position from ``load_from``; then
    save all three to ``save_to`` (the position in the manifest, ``data=``)."""
    from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

    model = TorchMLP(WIDTHS)
    if init is not None:
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
    dp = DataParallel(model)
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.AdamW, **ADAMW)
    sampler = ResumableSampler(range(SAMPLES), seed=SEED, global_batch_size=GLOBAL_BATCH)
    if load_from is not None:
        opt.load(load_from, model=model, data=sampler)
    train_steps(dp, opt, sampler, steps)
    opt.save(save_to, model=model, data=sampler)
