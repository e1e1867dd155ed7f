"""The six differentiable collectives of tensor/context parallelism (docs/design.md §6).

Megatron-LM's ``f``/``g`` operators (arXiv:1909.08053 §3) and their sequence-parallel pair
(arXiv:2205.05198 §4.2), over a NAMED group passed as an argument, never a module global:

============================  ======================  ======================
mapping                       forward                 backward
============================  ======================  ======================
``copy_to``                   identity                all-reduce
``reduce_from``               all-reduce              identity
``scatter_to``                split, keep own chunk   all-gather
``gather_from``               all-gather              split
``reduce_scatter_to``         reduce-scatter          all-gather
``all_gather_from``           all-gather              reduce-scatter
============================  ======================  ======================

Splits follow ``split_shapes`` (uneven ones included). Collectives that need equal pieces
(gloo's all-gather, every backend's single-tensor reduce-scatter) get pieces padded to the
largest chunk and trimmed after. On a group of one rank every mapping is the identity.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradsync_core import split_shapes

# torch 2.13 renamed the single-tensor collectives; older releases only have the old names.
from gradsync_torch._collectives import all_gather_single as _all_gather_single
from gradsync_torch._collectives import reduce_scatter_single as _reduce_scatter_single
from gradsync_torch.groups import Group

GroupLike = Group | ProcessGroup


def _resolve(group: GroupLike) -> tuple[ProcessGroup | None, int, int]:
    """(process group or None, size, this rank's position)."""
    if isinstance(group, Group):
        return group.pg, group.size, group.group_rank
    if isinstance(group, ProcessGroup):
        return group, dist.get_world_size(group), dist.get_rank(group)
    raise TypeError(
        f"group must be a gradsync_torch Group (ProcessGroups(...)['tp']) or a "
        f"torch ProcessGroup, got {type(group).__name__}"
    )


def _all_reduce(x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
    # A fresh buffer: the input may be a saved activation or a gradient other nodes share.
    out = x.contiguous().clone()
    dist.all_reduce(out, group=pg)
    return out


def _split(x: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int) -> torch.Tensor:
    return x.split(list(sizes), dim=dim)[rank].contiguous()


def _gather(x: torch.Tensor, dim: int, sizes: tuple[int, ...], pg: ProcessGroup) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim``; chunk ``r`` has ``sizes[r]`` elements."""
    n, width = len(sizes), max(sizes)
    piece = x.movedim(dim, 0)
    if piece.shape[0] < width:  # pad to the widest chunk, trimmed below
        pad = piece.new_zeros((width - piece.shape[0], *piece.shape[1:]))
        piece = torch.cat([piece, pad])
    piece = piece.contiguous()
    out = piece.new_empty((n * width, *piece.shape[1:]))
    _all_gather_single(out, piece, group=pg)
    if len(set(sizes)) > 1:
        out = torch.cat([c[:s] for c, s in zip(out.split(width), sizes, strict=True)])
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(
    x: torch.Tensor, dim: int, sizes: tuple[int, ...], rank: int, pg: ProcessGroup
) -> torch.Tensor:
    """Sum over ranks, keep chunk ``rank`` (``sizes[rank]`` elements) along ``dim``."""
    width = max(sizes)
    full = x.movedim(dim, 0)
    if len(set(sizes)) > 1:
        padded = full.new_zeros((len(sizes) * width, *full.shape[1:]))
        for i, chunk in enumerate(full.split(list(sizes))):
            padded[i * width : i * width + chunk.shape[0]] = chunk
        full = padded
    full = full.contiguous()
    out = full.new_empty((width, *full.shape[1:]))
    _reduce_scatter_single(out, full, group=pg)
    return out[: sizes[rank]].movedim(0, dim).contiguous()


def _gather_sizes(
    x: torch.Tensor, dim: int, size: int | None, n: int, rank: int, pg: ProcessGroup, who: str
) -> tuple[int, ...]:
    """Chunk sizes of a gather: ``split_shapes(size, n)``, or exchanged when size is None."""
    local = x.shape[dim]
    if size is None:
        # One small extra collective buys uneven pieces without the caller knowing them.
        mine = torch.tensor([local], dtype=torch.int64, device=x.device)
        every = mine.new_empty(n)
        _all_gather_single(every, mine, group=pg)
        return tuple(int(s) for s in every.tolist())
    sizes = split_shapes(size, n)
    if local != sizes[rank]:
        raise ValueError(
            f"{who}: this rank (position {rank} of {n}) holds {local} elements along dim "
            f"{dim}, but split_shapes({size}, {n}) = {sizes} gives it {sizes[rank]}; pass the "
            "full size of that dim, or size=None to exchange the chunk sizes"
        )
    return sizes


class _CopyTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.pg), None


class _ReduceFrom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pg: ProcessGroup) -> torch.Tensor:
        return _all_reduce(x, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _ScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pg: ProcessGroup, dim: int, rank: int) -> torch.Tensor:
        ctx.pg, ctx.dim = pg, dim
        ctx.sizes = split_shapes(x.shape[dim], dist.get_world_size(pg))
        return _split(x, dim, ctx.sizes, rank)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.sizes, ctx.pg), None, None, None


class _GatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, pg: ProcessGroup, dim: int, sizes: tuple[int, ...], rank: int
    ) -> torch.Tensor:
        ctx.dim, ctx.sizes, ctx.rank = dim, sizes, rank
        return _gather(x, dim, sizes, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return _split(grad, ctx.dim, ctx.sizes, ctx.rank), None, None, None, None


class _ReduceScatterTo(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pg: ProcessGroup, dim: int, rank: int) -> torch.Tensor:
        ctx.pg, ctx.dim = pg, dim
        ctx.sizes = split_shapes(x.shape[dim], dist.get_world_size(pg))
        return _reduce_scatter(x, dim, ctx.sizes, rank, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _gather(grad, ctx.dim, ctx.sizes, ctx.pg), None, None, None


class _AllGatherFrom(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, x: torch.Tensor, pg: ProcessGroup, dim: int, sizes: tuple[int, ...], rank: int
    ) -> torch.Tensor:
        ctx.pg, ctx.dim, ctx.sizes, ctx.rank = pg, dim, sizes, rank
        return _gather(x, dim, sizes, pg)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        out = _reduce_scatter(grad, ctx.dim, ctx.sizes, ctx.rank, ctx.pg)
        return out, None, None, None, None


def copy_to(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Enter a parallel region: identity forward, all-reduce backward (Megatron's ``f``).

    Use before a column-parallel layer whose input is replicated over ``group``.

    Example:
        >>> y = copy_to(x, groups["tp"]) @ w_shard.T
    """
    pg, n, _ = _resolve(group)
    return x if n == 1 else _CopyTo.apply(x, pg)


def reduce_from(x: torch.Tensor, group: GroupLike) -> torch.Tensor:
    """Leave a parallel region: all-reduce forward, identity backward (Megatron's ``g``).

    Example:
        >>> y = reduce_from(h_shard @ w_shard.T, groups["tp"])
    """
    pg, n, _ = _resolve(group)
    return x if n == 1 else _ReduceFrom.apply(x, pg)


def scatter_to(x: torch.Tensor, group: GroupLike, *, dim: int = -1) -> torch.Tensor:
    """Keep this rank's ``split_shapes`` chunk of ``x`` along ``dim``; all-gather backward.

    Example:
        >>> scatter_to(torch.ones(2, 10), groups["tp"], dim=1).shape  # tp=4, rank 3
        torch.Size([2, 1])
    """
    pg, n, rank = _resolve(group)
    return x if n == 1 else _ScatterTo.apply(x, pg, dim % x.dim(), rank)


def gather_from(
    x: torch.Tensor, group: GroupLike, *, dim: int = -1, size: int | None = None
) -> torch.Tensor:
    """Concatenate every rank's chunk along ``dim``; backward keeps this rank's chunk.

    Args:
        x: this rank's chunk.
        group: the group whose chunks are gathered.
        dim: the dimension to concatenate.
        size: the full size of ``dim``; chunks must then be ``split_shapes(size, n)``.
            ``None`` exchanges the chunk sizes (one small extra all-gather; any sizes work).

    Raises:
        ValueError: if this rank's chunk does not match ``split_shapes(size, n)``.
    """
    pg, n, rank = _resolve(group)
    if n == 1:
        return x
    assert pg is not None  # a group of more than one rank has its process group
    dim %= x.dim()
    sizes = _gather_sizes(x, dim, size, n, rank, pg, "gather_from")
    return _GatherFrom.apply(x, pg, dim, sizes, rank)


def reduce_scatter_to(x: torch.Tensor, group: GroupLike, *, dim: int = 0) -> torch.Tensor:
    """Sum ``x`` over ``group`` and keep this rank's chunk along ``dim``; all-gather backward.

    Use after a row-parallel layer under sequence parallelism (``dim`` = the sequence dim).
    """
    pg, n, rank = _resolve(group)
    return x if n == 1 else _ReduceScatterTo.apply(x, pg, dim % x.dim(), rank)


def all_gather_from(
    x: torch.Tensor, group: GroupLike, *, dim: int = 0, size: int | None = None
) -> torch.Tensor:
    """All-gather chunks along ``dim``; backward reduce-scatters (sequence parallelism).

    Unlike ``gather_from``, the gathered tensor feeds rank-specific computation (a
    column-parallel layer), so each rank's gradient of it is partial and must be summed.
    ``size`` as in ``gather_from``.
    """
    pg, n, rank = _resolve(group)
    if n == 1:
        return x
    assert pg is not None  # a group of more than one rank has its process group
    dim %= x.dim()
    sizes = _gather_sizes(x, dim, size, n, rank, pg, "all_gather_from")
    return _AllGatherFrom.apply(x, pg, dim, sizes, rank)
