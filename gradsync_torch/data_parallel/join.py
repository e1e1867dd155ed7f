"""Uneven inputs: ``DataParallel`` under torch's ``Join`` (DDP's ``join()``).

docs/torch-data-parallel.md, "Uneven inputs".

A rank that ran out of batches leaves its loop and waits in ``Join.__exit__``; for every
forward the other ranks still run, ``Join`` calls this hook once (it counts the ranks that
have not joined with one all-reduce the others issue in ``Join.notify_join_context``). The
hook shadows that step's collectives in the order the others issue them:

1. the join status (``exchange_status``): one all-reduce saying whether this step syncs,
   whether buffers are broadcast, and which ranks are still running;
2. the buffer broadcast, from the highest rank still running (DDP's authoritative rank);
3. the synced backward: every bucket with zeros, the used-map with the agreement check
   (``Reducer.shadow_sync``), and the one-time rebuild broadcast.

Divisor semantics are DDP's: ``divide_by_initial_world_size=True`` keeps dividing by the group
size (every sample weighs the same), ``False`` divides by the ranks still running. When every
rank has joined, the model of a last joiner is broadcast to all (``post_hook``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import JoinHook

from gradsync_torch._collectives import broadcast_tensors


class JoinStatus(NamedTuple):
    """What the ranks still running do in this step, as every rank reads it."""

    sync: bool  # the backward of this forward syncs
    buffers: bool  # the forward broadcasts buffers
    active: int  # ranks that have not joined
    source: int  # group rank of the highest rank still running (-1: none)


def exchange_status(
    group: dist.ProcessGroup, device: torch.device, *, running: bool, sync: bool, buffers: bool
) -> JoinStatus:
    """One summing all-reduce: ``[sync, buffers, one-hot of this group rank]``, zeros from a
    joined rank (``running=False``). Every rank of ``group`` calls it once per step."""
    size = group.size()
    flags = torch.zeros(2 + size, dtype=torch.int64, device=device)
    if running:
        flags[0], flags[1], flags[2 + dist.get_rank(group)] = int(sync), int(buffers), 1
    dist.all_reduce(flags, group=group)
    values = flags.tolist()
    ranks = [r for r in range(size) if values[2 + r]]
    return JoinStatus(values[0] > 0, values[1] > 0, len(ranks), max(ranks, default=-1))


def common_rank(group: dist.ProcessGroup, device: torch.device, candidate: bool) -> int:
    """The highest group rank among the candidates (DDP's ``_find_common_rank``)."""
    rank = torch.tensor([dist.get_rank(group) if candidate else -1], device=device)
    dist.all_reduce(rank, op=dist.ReduceOp.MAX, group=group)
    return int(rank.item())


class DataParallelJoinHook(JoinHook):
    """The ``JoinHook`` of a ``DataParallel`` (what ``DataParallel.join_hook`` returns).

    Args:
        model: the ``DataParallel`` (typed loosely: the wrapper imports this module).
        divide_by_initial_world_size: DDP's divisor choice, recorded for inspection.
    """

    def __init__(self, model: Any, *, divide_by_initial_world_size: bool) -> None:
        self.model = model
        self.divide_by_initial_world_size = divide_by_initial_world_size
        super().__init__()

    def main_hook(self) -> None:
        """Shadow one step of the ranks still running (see the module docstring)."""
        self.model._shadow_step()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Every rank gets the parameters and buffers of a last joiner."""
        model = self.model
        source = common_rank(model.process_group, model.join_device, is_last_joiner)
        tensors = list(model.module.parameters())
        if model.options.broadcast_buffers:
            tensors += list(model.module.buffers())
        broadcast_tensors(tensors, model.process_group, group_src=source)
