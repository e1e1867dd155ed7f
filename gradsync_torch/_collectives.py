"""Small collective helpers shared by the data-parallel wrapper, ZeRO and the mappings.

One home for the torch-version shims and the reduce-scatter pattern, so the callers do not
each carry a copy that drifts.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

MIB = 1024 * 1024

# torch renamed the single-tensor collectives; take the new name where it exists.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` inside ``group`` (``None`` or WORLD: the same)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


def reduce_scatter(send: torch.Tensor, out: torch.Tensor, group: Any, world_size: int) -> list:
    """Start summing ``send`` over the group into this rank's chunk ``out``.

    On gloo, ``reduce_scatter`` goes through lists and measured slower here than one
    ``reduce`` per owner (1.0-1.8x at 2 and 4 ranks, 25 MiB buckets); the sums are the same.
    Call ``finish_reduce_scatter`` with the returned handles.
    """
    if world_size == 1:
        return []
    chunk = out.numel()
    if dist.get_backend(group) == "gloo":
        return [
            dist.reduce(
                send[r * chunk : (r + 1) * chunk],
                dst=global_rank(group, r),
                group=group,
                async_op=True,
            )
            for r in range(world_size)
        ]
    return [dist.reduce_scatter_tensor(out, send, group=group, async_op=True)]


def finish_reduce_scatter(
    send: torch.Tensor, out: torch.Tensor, handles: list, group: Any, rank: int, world_size: int
) -> None:
    """Wait for ``reduce_scatter``'s handles and leave this rank's summed chunk in ``out``."""
    for handle in handles:
        handle.wait()
    if world_size == 1 or dist.get_backend(group) == "gloo":
        out.copy_(send[rank * out.numel() : (rank + 1) * out.numel()])
