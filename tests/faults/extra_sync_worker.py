"""Spawned by ``test_extra_sync.py``: rank 1 takes one training step more than rank 0, which
meanwhile goes on to the end of its loop (no ``Join``)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradsync_torch as gt
from tests.torch.dp_grad_checks import mlp


def extra_sync(rank: int, ws: int, after: str) -> str:
    """Returns the error this rank ended with (one per rank is expected)."""
    model = gt.DataParallel(mlp(seed=0))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    try:
        for _ in range(2 + rank):
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
        if after == "barrier":
            dist.barrier()
        else:
            dist.all_reduce(torch.zeros(3))
    except RuntimeError as e:
        return str(e)
    return "no error"
