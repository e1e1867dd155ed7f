"""Small collective helpers shared by the data-parallel wrapper, ZeRO and the mappings.

One home for the torch-version shims, the reduce-scatter (``reduce_scatter_into``) and the
chunked broadcast of module state, so the callers do not each carry a copy that drifts.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import MIB

# torch renamed the single-tensor collectives; take the new name where it exists.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# How torch's backends report a collective whose peer left: gloo raises a plain RuntimeError
# ("Connection closed by peer [127.0.0.1]:port", "Read error ...: Connection reset by peer",
# "Socket closed"; "Timed out waiting 5000ms for recv operation to complete", or "Application
# timeout caused pair closure" when the peer's own collective timed out first), NCCL a
# DistBackendError (for both).
_CLOSED = ("Connection closed", "Connection reset", "connection reset", "Socket closed")
_TIMED_OUT = ("Timed out", "timed out", "timeout caused pair closure")


def peer_closed(cause: BaseException) -> bool:
    """Whether ``cause`` reports that a peer closed or reset its connection (it died or ended)."""
    return any(m in str(cause) for m in _CLOSED)


def peer_failed(cause: BaseException) -> bool:
    """Whether ``cause`` is a backend's report that a peer never completed a collective (a
    timeout, a closed connection), rather than an error of the call itself."""
    return (
        isinstance(cause, dist.DistError)
        or peer_closed(cause)
        or any(m in str(cause) for m in _TIMED_OUT)
    )


def global_rank(group: Any, group_rank: int) -> int:
    """The global rank of ``group_rank`` inside ``group`` (``None`` or WORLD: the same)."""
    if group is None or group is dist.group.WORLD:
        return group_rank
    return dist.get_global_rank(group, group_rank)


class ReduceScatterWork:
    """A reduce-scatter in flight (``reduce_scatter_into``); ``wait()`` completes it.

    ``wait`` is idempotent: after the first call ``out`` holds this rank's summed chunk.
    """

    __slots__ = ("_finish", "_handles")

    def __init__(self, handles: list, finish: Any = None) -> None:
        self._handles = handles
        self._finish = finish

    def wait(self) -> None:
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.wait()
        finish, self._finish = self._finish, None
        if finish is not None:
            finish()


def reduce_scatter_into(
    out: torch.Tensor, flat: torch.Tensor, group: Any, *, tag: int = 0
) -> ReduceScatterWork:
    """Start summing ``flat`` over ``group`` into this rank's chunk ``out``.

    ``flat`` holds ``group.size()`` chunks of ``out.numel()`` elements; group rank ``r``
    receives the sum of chunk ``r``. The one reduce-scatter of the torch executor: ZeRO-2's
    buckets (``data_parallel/grad_sharding.py``, ``zero/flat.py``) call it, and so can the
    ZeRO-3 executor. ``flat`` is scratch until ``wait()`` returns (gloo's ``reduce`` writes
    partial sums into it); ``out`` must not overlap it. Returns at once; call ``wait()``.

    How, measured on gloo (``benchmarks/torch_zero.py``'s machine, 2 cores; docs/design.md
    §11): torch 2.13's gloo ``reduce_scatter_tensor`` and the list ``reduce_scatter`` copy
    through lists and measured 1.4-2x slower than the alternatives, so on gloo

    - 2 ranks: one pairwise exchange, ``isend`` of the peer's chunk and ``irecv`` straight into
      ``out``, then ``out += flat[mine]`` (each rank moves half a bucket, no scratch buffer;
      ``a + b`` is commutative in IEEE arithmetic, so the sum has the bits of any other
      two-rank sum), 1.5-2x faster than one ``reduce`` per owner;
    - more ranks: one asynchronous ``reduce`` per owner (a ring of point-to-point steps
      waits on every rank in turn, and measured slower with more ranks than cores);
    - other backends (NCCL): ``reduce_scatter_tensor``.
    """
    world = group.size() if group is not None else dist.get_world_size()
    chunk = out.numel()
    rank = dist.get_rank(group)
    mine = flat[rank * chunk : (rank + 1) * chunk]
    if world == 1:
        out.copy_(mine)
        return ReduceScatterWork([])
    if dist.get_backend(group) != "gloo":
        return ReduceScatterWork([reduce_scatter_single(out, flat, group=group, async_op=True)])
    if world == 2:
        peer = 1 - rank
        dst = global_rank(group, peer)
        handles = [
            dist.isend(flat[peer * chunk : (peer + 1) * chunk], dst, group=group, tag=tag),
            dist.irecv(out, dst, group=group, tag=tag),
        ]
        return ReduceScatterWork(handles, lambda: out.add_(mine))
    handles = [
        dist.reduce(
            flat[r * chunk : (r + 1) * chunk], dst=global_rank(group, r), group=group, async_op=True
        )
        for r in range(world)
    ]
    return ReduceScatterWork(handles, lambda: out.copy_(mine))


# DDP broadcasts module states in chunks of this size (torch.distributed.utils).
BROADCAST_CHUNK_BYTES = 250 * MIB


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, *, group_src: int = 0
) -> None:
    """Overwrite ``tensors`` in place with group rank ``group_src``'s values.

    Tensors are packed per (dtype, device) into flat chunks of at most 250 MiB (DDP's
    ``_sync_module_states`` does the same), so a model costs a few collectives, not one per
    tensor.
    """
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for tensor in tensors:
        by_key.setdefault((tensor.dtype, tensor.device), []).append(tensor)
    for members in by_key.values():
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in [*members, None]:
            if t is not None and (not chunk or nbytes + t.nbytes <= BROADCAST_CHUNK_BYTES):
                chunk.append(t)
                nbytes += t.nbytes
                continue
            flat = torch.cat([c.detach().reshape(-1) for c in chunk])
            dist.broadcast(flat, src=global_rank(group, group_src), group=group)
            offset = 0
            with torch.no_grad():
                for c in chunk:
                    c.copy_(flat[offset : offset + c.numel()].view_as(c))
                    offset += c.numel()
            # freed here, not whenever gloo's thread drops its work (then the profiler,
            # which sees only this thread, never records the free)
            flat.untyped_storage().resize_(0)
            if t is not None:
                chunk, nbytes = [t], t.nbytes
