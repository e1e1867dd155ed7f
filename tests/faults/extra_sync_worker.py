"""Spawned by ``test_extra_sync.py``: rank 1 takes one training step more than rank 0, which
meanwhile goes on to the end of its loop (no ``Join``); or rank 1 dies in the middle of the
loop (``os._exit``) while rank 0 trains on."""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from torch.nn import functional as F

import gradsync_torch as gt
from tests.torch.dp_grad_checks import mlp

DIED = 17


def _ended(e: RuntimeError) -> tuple[str, str]:
    """The error, and the first line of the backend's error under it (itself if none)."""
    cause = e.__cause__ if e.__cause__ is not None else e
    return str(e), str(cause).strip().splitlines()[0]


def extra_sync(
    rank: int, ws: int, after: str, buffers: bool = False, linger_s: float = 0.0
) -> tuple[str, str]:
    """Returns the error this rank ended with and the backend's first line under it (one error
    per rank is expected). ``buffers``: the model
    has a buffer (a causal mask, BatchNorm statistics), so each training forward after a synced
    one starts with DataParallel's buffer broadcast, the extra step's first collective.
    ``linger_s``: how long the rank that stopped early keeps its process (and so its
    connections) alive after its own error, so the other rank's wait ends in its own timeout
    rather than in the closed connection of a process that exited first (which a loaded
    machine's scheduling can otherwise produce)."""
    net = mlp(seed=0)
    if buffers:
        net.register_buffer("mask", torch.ones(3))
    model = gt.DataParallel(net)
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
        if rank == 0:
            time.sleep(linger_s)
        return _ended(e)
    return "no error", ""


def peer_dies(rank: int, ws: int) -> tuple[str, str]:
    """Rank 1 exits without a word after two steps; rank 0 runs two more. Returns rank 0's
    error and the backend's first line under it."""
    model = gt.DataParallel(mlp(seed=0))
    x, y = torch.randn(4, 6), torch.randn(4, 3)
    try:
        for step in range(4):
            if rank == 1 and step == 2:
                os._exit(DIED)
            model.zero_grad(set_to_none=True)
            F.mse_loss(model(x), y).backward()
    except RuntimeError as e:
        return _ended(e)
    return "no error", ""
