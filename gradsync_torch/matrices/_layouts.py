"""How each matrix reaches its owner whole and goes back: the owner path's data movement.

Two layouts, one per way the ranks hold a matrix (docs/matrix-optimizers.md):

- ``RowsLayout``: ``fully_shard``'s dim-0 rows (ZeRO-3). One all-to-all hands every owner
  the rows of the gradient and of the parameter of its matrices from every rank; the owner
  steps the whole matrix; a second all-to-all hands every rank back its updated rows.
- ``ReplicatedLayout``: whole parameters on every rank (ZeRO-1 and ZeRO-2). The gradients
  are averaged already (``DataParallel``, DDP: ZeRO-1), or each matrix's local gradients are
  reduced to its owner only (``shard_gradients=True``: ZeRO-2, each rank keeps the gradients
  of its own matrices); the owner steps the matrix in place and broadcasts it.

A layout has two verbs, ``gather`` (before the owner's step: every owner's ``Matrix.whole``
holds the gradient and the parameter) and ``scatter`` (after it: every rank's parameter holds
the new values), and counts the elements it moved (``exchanged``), which the plan predicts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from gradsync_core import OwnerExchange, chunk_rows
from gradsync_torch._collectives import broadcast_tensors, global_rank
from gradsync_torch.param_sharding._rows import as_row_sharded


@dataclass(slots=True, kw_only=True)
class Matrix:
    """One parameter of the matrix optimizer: where it lives and who steps it."""

    index: int  # global index over the optimizer's param groups
    name: str
    param: torch.Tensor  # the user's parameter (a row-sharded DTensor, or a whole tensor)
    shape: tuple[int, ...]  # the whole parameter's
    owner: int  # group rank
    group: int  # param group index
    whole: torch.Tensor | None = None  # on the owner: the tensor its local optimizer steps

    @property
    def numel(self) -> int:
        return self.param.numel()


def _has_grad(matrices: Sequence[Matrix], group: Any, world_size: int) -> list[bool]:
    """Which matrices some rank has a gradient for (a plain optimizer skips the others). A
    matrix that only some ranks computed one for gets their sum with the others' zeros, as
    the gradient reductions do (docs/design.md §7)."""
    flags = torch.tensor([m.param.grad is not None for m in matrices], dtype=torch.uint8)
    if world_size > 1 and flags.numel():
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    return [bool(f) for f in flags.tolist()]


class RowsLayout:
    """The matrices of a ``fully_shard``-ed model: each rank holds rows ``chunk_rows`` of each.

    Args:
        matrices: every matrix, in plan order; ``whole`` set on its owner.
        group: the shard group (the mesh's only dimension).
        rank, world_size: this rank's place in it.
    """

    def __init__(self, matrices: Sequence[Matrix], group: Any, rank: int, world_size: int) -> None:
        self.matrices = list(matrices)
        self.group, self.rank, self.world_size = group, rank, world_size
        self.stepped: list[bool] = [False] * len(self.matrices)
        self.exchanged = OwnerExchange(sent_numel=0, received_numel=0)
        # Elements of rows held by each rank of each matrix: rows(m, r) * row numel.
        self._held = [[self._rows(m, r) for r in range(world_size)] for m in self.matrices]

    def _rows(self, m: Matrix, rank: int) -> tuple[int, int]:
        """Elements ``[start, stop)`` of the flattened matrix that ``rank`` holds."""
        start, stop, _ = chunk_rows(m.shape[0], self.world_size, rank)
        row = m.numel // m.shape[0] if m.shape[0] else 0
        return start * row, stop * row

    def _by_dtype(self) -> dict[torch.dtype, list[int]]:
        out: dict[torch.dtype, list[int]] = {}
        for i, m in enumerate(self.matrices):
            if self.stepped[i]:
                out.setdefault(m.param.dtype, []).append(i)
        return out

    def gather(self) -> None:
        """Every owner's ``whole`` gets the gradient (as ``.grad``) and the parameter."""
        self.stepped = _has_grad(self.matrices, self.group, self.world_size)
        sent = received = 0
        for indices in self._by_dtype().values():
            s, r = self._gather(indices)
            sent, received = sent + s, received + r
        for i, m in enumerate(self.matrices):
            if m.whole is not None and not self.stepped[i]:
                m.whole.grad = None
        self._gathered = (sent, received)

    def _gather(self, indices: list[int]) -> tuple[int, int]:
        n, me = self.world_size, self.rank
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        in_split, out_split = [0] * n, [0] * n
        for i in indices:
            m = self.matrices[i]
            rows = cast(DTensor, m.param).to_local().reshape(-1)
            grad = m.param.grad
            grad_rows = (
                torch.zeros_like(rows)
                if grad is None
                else cast(DTensor, grad).to_local().reshape(-1)
            )
            send_parts[m.owner] += [grad_rows, rows]
            in_split[m.owner] += 2 * rows.numel()
            if m.owner == me:
                for r in range(n):
                    lo, hi = self._held[i][r]
                    out_split[r] += 2 * (hi - lo)
        dtype = self.matrices[indices[0]].param.dtype
        send = torch.cat([t for parts in send_parts for t in parts]) if any(in_split) else None
        recv = torch.empty(sum(out_split), dtype=dtype)
        if send is None:
            send = torch.empty(0, dtype=dtype)
        if n > 1:
            dist.all_to_all_single(recv, send, out_split, in_split, group=self.group)
        else:
            recv.copy_(send)
        # recv: for each source rank, for each matrix this rank owns: gradient rows, then rows.
        pieces = recv.split(out_split)
        owned = [i for i in indices if self.matrices[i].owner == me]
        for r, piece in enumerate(pieces):
            offset = 0
            for i in owned:
                m = self.matrices[i]
                lo, hi = self._held[i][r]
                whole = cast(torch.Tensor, m.whole)
                if whole.grad is None:
                    whole.grad = torch.empty_like(whole)
                k = hi - lo
                with torch.no_grad():
                    whole.grad.view(-1)[lo:hi].copy_(piece[offset : offset + k])
                    whole.view(-1)[lo:hi].copy_(piece[offset + k : offset + 2 * k])
                offset += 2 * k
        return sum(in_split) - in_split[me], sum(out_split) - out_split[me]

    def scatter(self) -> None:
        """Every rank's rows of every stepped matrix from its owner's ``whole``."""
        sent, received = self._gathered
        for indices in self._by_dtype().values():
            s, r = self._scatter(indices)
            sent, received = sent + s, received + r
        self.exchanged = OwnerExchange(sent_numel=sent, received_numel=received)

    def _scatter(self, indices: list[int]) -> tuple[int, int]:
        n, me = self.world_size, self.rank
        send_parts: list[list[torch.Tensor]] = [[] for _ in range(n)]
        in_split, out_split = [0] * n, [0] * n
        for i in indices:
            m = self.matrices[i]
            if m.owner == me:
                flat = cast(torch.Tensor, m.whole).detach().reshape(-1)
                for r in range(n):
                    lo, hi = self._held[i][r]
                    send_parts[r].append(flat[lo:hi])
                    in_split[r] += hi - lo
            lo, hi = self._held[i][me]
            out_split[m.owner] += hi - lo
        dtype = self.matrices[indices[0]].param.dtype
        parts = [t for per_rank in send_parts for t in per_rank]
        send = torch.cat(parts) if parts else torch.empty(0, dtype=dtype)
        recv = torch.empty(sum(out_split), dtype=dtype)
        if n > 1:
            dist.all_to_all_single(recv, send, out_split, in_split, group=self.group)
        else:
            recv.copy_(send)
        offsets = [0] * n
        starts = [sum(out_split[:r]) for r in range(n)]
        for i in indices:
            m = self.matrices[i]
            lo, hi = self._held[i][me]
            o = m.owner
            new = recv[starts[o] + offsets[o] : starts[o] + offsets[o] + hi - lo]
            offsets[o] += hi - lo
            param = cast(DTensor, m.param)
            with torch.no_grad():
                # Through the DTensor, so its version counter moves as under any optimizer
                # step: a unit kept gathered sees its shards changed and gathers again.
                param.copy_(as_row_sharded(new.view(param.to_local().shape), param))
        return sum(in_split) - in_split[me], sum(out_split) - out_split[me]


class ReplicatedLayout:
    """Whole matrices on every rank (ZeRO-1; with ``shard_gradients``, ZeRO-2).

    The owner's ``whole`` is the parameter itself.
    """

    def __init__(
        self,
        matrices: Sequence[Matrix],
        group: Any,
        rank: int,
        world_size: int,
        *,
        shard_gradients: bool,
    ) -> None:
        self.matrices = list(matrices)
        self.group, self.rank, self.world_size = group, rank, world_size
        self.shard_gradients = shard_gradients
        self.stepped: list[bool] = [False] * len(self.matrices)
        self.exchanged = OwnerExchange(sent_numel=0, received_numel=0)
        self._received = self._sent = 0

    def gather(self) -> None:
        """ZeRO-2: reduce each matrix's local gradients (divided by the world size first,
        ``DataParallel``'s arithmetic) to its owner, and drop them everywhere else."""
        self.stepped = _has_grad(self.matrices, self.group, self.world_size)
        self._sent = self._received = 0
        if not self.shard_gradients:
            return
        n, me = self.world_size, self.rank
        for owner in range(n):
            members = [
                m
                for m, stepped in zip(self.matrices, self.stepped, strict=True)
                if stepped and m.owner == owner
            ]
            by_dtype: dict[torch.dtype, list[Matrix]] = {}
            for m in members:
                by_dtype.setdefault(m.param.dtype, []).append(m)
            for group in by_dtype.values():
                flat = torch.cat(
                    [
                        torch.zeros(m.numel, dtype=m.param.dtype)
                        if m.param.grad is None
                        else m.param.grad.reshape(-1) / n
                        for m in group
                    ]
                )
                if n > 1:
                    dist.reduce(flat, dst=global_rank(self.group, owner), group=self.group)
                numel = flat.numel()
                if owner == me:
                    self._received += (n - 1) * numel
                    offset = 0
                    for m in group:
                        m.param.grad = flat[offset : offset + m.numel].view(m.shape)
                        offset += m.numel
                else:
                    self._sent += numel
        for m in self.matrices:
            if m.owner != me:
                m.param.grad = None  # each rank keeps the gradients of its own matrices

    def scatter(self) -> None:
        """Broadcast each stepped matrix from its owner."""
        n, me = self.world_size, self.rank
        sent, received = self._sent, self._received
        for owner in range(n):
            members = [
                m.param
                for m, s in zip(self.matrices, self.stepped, strict=True)
                if s and m.owner == owner
            ]
            if not members:
                continue
            if n > 1:
                broadcast_tensors(members, self.group, group_src=owner)
            numel = sum(p.numel() for p in members)
            if owner == me:
                sent += (n - 1) * numel
            else:
                received += numel
        self.exchanged = OwnerExchange(sent_numel=sent, received_numel=received)
