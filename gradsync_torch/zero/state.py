"""ZeRO optimizer state in model space: assembling, slicing and moving it between ranks.

A rank's state is a list of ``StatePiece``: a whole parameter's state (ZeRO-1) or that of
elements ``[start, stop)`` of the flattened parameter (ZeRO-2, 1-D tensors). ``assemble``
joins pieces into per-parameter state, ``slice_state`` cuts what a piece steps, so state
moves between any two layouts: a consolidated ``state_dict``, a checkpoint written at another
world size, a re-plan (docs/design.md §9).

The helpers take the pieces, plans and group they need and return values; the optimizer
writes its own fields.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import ShardPlan
from gradsync_torch._collectives import global_rank
from gradsync_torch._optim_state import RankGroup, StatePiece, assemble, hyper_parameters
from gradsync_torch.zero.broadcast import Piece


def copy_hyper(src: list[dict[str, Any]], dst: list[dict[str, Any]]) -> None:
    """Copy hyper-parameters (lr set by a scheduler, betas, ...) between param groups."""
    for s, d in zip(src, dst, strict=True):
        d.update(hyper_parameters(s))


def state_nbytes(state: Mapping[Any, Mapping[str, Any]]) -> int:
    """Bytes of every tensor in an optimizer's ``state`` (what ZeRO divides by the ranks)."""
    return sum(
        v.numel() * v.element_size()
        for per_param in state.values()
        for v in per_param.values()
        if isinstance(v, torch.Tensor)
    )


def slice_state(state: dict[str, Any], piece: Piece, shape: tuple[int, ...]) -> dict[str, Any]:
    """The part of one parameter's model-space ``state`` that ``piece`` steps.

    Raises:
        ValueError: if a tensor is neither 0-d nor the parameter's size (such state cannot
            be cut into element ranges).
    """
    if piece.whole:
        return dict(state)
    numel, out = math.prod(shape), {}
    for key, value in state.items():
        if torch.is_tensor(value) and value.dim() >= 1:
            if value.numel() != numel:
                raise ValueError(
                    f"state {key!r} of parameter #{piece.index} has {value.numel()} elements, "
                    f"not the parameter's {numel}; it cannot be sharded by element ranges"
                )
            out[key] = value.reshape(-1)[piece.start : piece.stop].clone()
        else:
            out[key] = value.clone() if torch.is_tensor(value) else value
    return out


def local_pieces(
    pieces: Sequence[Piece], optimizer_state: Mapping[torch.Tensor, dict[str, Any]]
) -> list[StatePiece]:
    """This rank's state in model space: one ``StatePiece`` per layout piece that has state."""
    out = []
    for piece in pieces:
        state = optimizer_state.get(piece.tensor)
        if state:
            out.append(StatePiece(piece.index, piece.start, piece.stop, piece.whole, state))
    return out


def to_cpu(pieces: Sequence[StatePiece]) -> list[StatePiece]:
    """Copies of ``pieces`` with every tensor on the CPU (what object collectives send)."""
    return [
        piece._replace(
            state={
                k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                for k, v in piece.state.items()
            }
        )
        for piece in pieces
    ]


def consolidate(
    mine: Sequence[StatePiece], shapes: Sequence[tuple[int, ...]], ranks: RankGroup, to: int
) -> dict[int, Any] | None:
    """Every rank's state, assembled per parameter on group rank ``to`` (a collective);
    ``None`` on the other ranks."""
    gathered: list[Any] | None = [to_cpu(mine)]
    if ranks.world_size > 1:
        gathered = [None] * ranks.world_size if ranks.rank == to else None
        dist.gather_object(
            to_cpu(mine),
            gathered,
            dst=global_rank(ranks.process_group, to),
            group=ranks.process_group,
        )
    if gathered is None:
        return None
    return assemble([StatePiece(*piece) for pieces in gathered for piece in pieces], shapes)


def _moved(old_plan: ShardPlan, new_plan: ShardPlan) -> bool:
    """Whether any shard of ``old_plan`` changed owner or range in ``new_plan``."""
    before = {(s.name, s.start, s.stop): s.rank for s in old_plan.shards}
    after = {(s.name, s.start, s.stop): s.rank for s in new_plan.shards}
    return any(after.get(key) != rank for key, rank in before.items())


def carry_state(
    old_plan: ShardPlan,
    old: Sequence[StatePiece],
    new_plan: ShardPlan,
    new_pieces: Sequence[Piece],
    shapes: Sequence[tuple[int, ...]],
    ranks: RankGroup,
) -> list[dict[str, Any] | None]:
    """The state of each piece of a rebuilt layout (``None``: no state yet), on its device.

    Kept pieces keep theirs; if any piece changed owner or range (a frozen parameter became
    trainable, a re-plan), every rank's state travels through model space to the new owners
    (rare: one all-gather).
    """
    kept = {(piece.index, piece.start, piece.stop): piece.state for piece in old}
    full: dict[int, Any] = {}
    if _moved(old_plan, new_plan):
        gathered: list[Any] = [to_cpu(old)]
        if ranks.world_size > 1:
            gathered = [None] * ranks.world_size
            dist.all_gather_object(gathered, to_cpu(old), group=ranks.process_group)
        full = assemble([StatePiece(*piece) for pieces in gathered for piece in pieces], shapes)
    carried: list[dict[str, Any] | None] = []
    for piece in new_pieces:
        state = kept.get((piece.index, piece.start, piece.stop))
        if state is None and piece.index in full:
            state = slice_state(full[piece.index], piece, shapes[piece.index])
        if state is not None:
            device = piece.tensor.device
            state = {
                k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()
            }
        carried.append(state)
    return carried


def local_state_dict(
    pieces: Sequence[Piece],
    full: Mapping[int, dict[str, Any]],
    shapes: Sequence[tuple[int, ...]],
    groups: Sequence[Mapping[str, Any]],
) -> dict[str, Any]:
    """The local optimizer's ``state_dict`` for ``pieces`` (in its order): their slices of
    ``full`` (model-space state by global index) and the hyper-parameters of ``groups``.
    Loading it with the local optimizer's own ``load_state_dict`` casts state to each
    parameter's dtype and device as torch does."""
    local_state = {
        position: slice_state(full[piece.index], piece, shapes[piece.index])
        for position, piece in enumerate(pieces)
        if piece.index in full
    }
    local_groups, position = [], 0
    for g, group in enumerate(groups):
        count = sum(1 for piece in pieces if piece.group == g)
        local_groups.append(
            {**hyper_parameters(group), "params": list(range(position, position + count))}
        )
        position += count
    return {"state": local_state, "param_groups": local_groups}
