"""ZeRO optimizer state in model space: assembling, slicing and moving it between ranks.

A rank's state is a list of pieces ``(global index, start, stop, whole, state)``: a whole
parameter's state (ZeRO-1) or that of elements ``[start, stop)`` of the flattened parameter
(ZeRO-2, 1-D tensors). ``assemble`` joins pieces into per-parameter state, ``slice_state``
cuts what a piece steps, so state moves between any two layouts: a consolidated
``state_dict``, a checkpoint written at another world size, a re-plan.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from gradsync_core import ShardPlan

if TYPE_CHECKING:
    from gradsync_torch._zero import ZeroRedundancyOptimizer
    from gradsync_torch._zero_layout import Piece

# (global index, start, stop, whole, state): a piece of one parameter's state in model space.
StatePiece = tuple[int, int, int, bool, dict[str, Any]]


def assemble(pieces: Sequence[StatePiece], shapes: Sequence[tuple[int, ...]]) -> dict[int, Any]:
    """Per-parameter state from pieces: whole ones as they are; flat slices concatenated in
    element order and reshaped to the parameter (0-d entries taken from the first slice).

    Raises:
        ValueError: if the slices of a parameter do not cover it exactly once.
    """
    by_index: dict[int, list[StatePiece]] = defaultdict(list)
    for piece in pieces:
        by_index[piece[0]].append(piece)
    full: dict[int, Any] = {}
    for index, parts in by_index.items():
        if len(parts) == 1 and parts[0][3]:
            full[index] = parts[0][4]
            continue
        parts.sort(key=lambda p: p[1])
        numel, cursor = math.prod(shapes[index]), 0
        for _, start, stop, _, _ in parts:
            if start != cursor:
                break
            cursor = stop
        if cursor != numel:
            raise ValueError(
                f"the state slices of parameter #{index} cover elements up to {cursor} of "
                f"{numel}: a rank file is missing or from another save"
            )
        state = {}
        for key, first in parts[0][4].items():
            if torch.is_tensor(first) and first.dim() >= 1:
                state[key] = torch.cat([p[4][key].reshape(-1) for p in parts]).view(shapes[index])
            else:
                state[key] = first
        full[index] = state
    return full


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


def local_pieces(opt: ZeroRedundancyOptimizer, *, cpu: bool = False) -> list[StatePiece]:
    """This rank's state in model space: one ``StatePiece`` per piece that has state."""
    out = []
    for p in opt.layout.pieces:
        state = opt.optim.state.get(p.tensor)
        if state:
            if cpu:
                state = {
                    k: v.detach().cpu().clone() if torch.is_tensor(v) else v
                    for k, v in state.items()
                }
            out.append((p.index, p.start, p.stop, p.whole, state))
    return out


def consolidate(opt: ZeroRedundancyOptimizer, to: int) -> dict[int, Any] | None:
    """Every rank's state, assembled per parameter on group rank ``to`` (a collective)."""
    mine = local_pieces(opt, cpu=True)
    gathered: list[Any] | None = [mine]
    if opt.world_size > 1:
        gathered = [None] * opt.world_size if opt.rank == to else None
        dist.gather_object(mine, gathered, dst=opt._comm.global_rank(to), group=opt.process_group)
    if gathered is None:
        return None
    shapes = [tuple(p.shape) for p in opt._params()]
    return assemble([piece for pieces in gathered for piece in pieces], shapes)


def carry_state(opt: ZeroRedundancyOptimizer, old_plan: ShardPlan, old: list[StatePiece]) -> None:
    """Give the pieces of a rebuilt layout their state: kept pieces keep theirs; if any
    piece changed owner or range (a frozen parameter became trainable, a re-plan), every
    rank's state travels through model space to the new owners (rare: one all-gather)."""
    before = {(s.name, s.start, s.stop): s.rank for s in old_plan.shards}
    after = {(s.name, s.start, s.stop): s.rank for s in opt.layout.plan.shards}
    moved = any(k in after and after[k] != r for k, r in before.items()) or any(
        k not in after for k in before
    )
    kept = {(i, start, stop): state for i, start, stop, _, state in old}
    full: dict[int, Any] = {}
    if moved and opt.world_size > 1:
        gathered: list[Any] = [None] * opt.world_size
        mine = [
            (i, a, b, w, {k: v.cpu() if torch.is_tensor(v) else v for k, v in st.items()})
            for i, a, b, w, st in old
        ]
        dist.all_gather_object(gathered, mine, group=opt.process_group)
        shapes = [tuple(p.shape) for p in opt._params()]
        full = assemble([piece for pieces in gathered for piece in pieces], shapes)
    elif moved:
        full = assemble(old, [tuple(p.shape) for p in opt._params()])
    params = opt._params()
    for piece in opt.layout.pieces:
        state = kept.get((piece.index, piece.start, piece.stop))
        if state is None and piece.index in full:
            state = slice_state(full[piece.index], piece, tuple(params[piece.index].shape))
        if state is not None:
            device = piece.tensor.device
            opt.optim.state[piece.tensor] = {
                k: v.to(device) if torch.is_tensor(v) and v.dim() else v for k, v in state.items()
            }


def load_full_state(
    opt: ZeroRedundancyOptimizer,
    full: dict[int, dict[str, Any]],
    shapes: list[tuple[int, ...]],
    groups: list[dict[str, Any]],
) -> None:
    """Hand this rank's slices of ``full`` (model-space state by global index) and the
    hyper-parameters of ``groups`` to the local optimizer's own ``load_state_dict``, which
    casts state to each parameter's dtype and device as torch does."""
    pieces = opt._local_pieces()
    local_state = {}
    for local_index, piece in enumerate(pieces):
        if piece.index in full:
            local_state[local_index] = slice_state(full[piece.index], piece, shapes[piece.index])
    local_groups, position = [], 0
    for g, group in enumerate(groups):
        count = sum(1 for p in pieces if p.group == g)
        hyper = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        local_groups.append({**hyper, "params": list(range(position, position + count))})
        position += count
    for src, dst in zip(groups, opt.param_groups, strict=True):
        dst.update({k: v for k, v in src.items() if k not in ("params", "param_names")})
    opt.optim.load_state_dict({"state": local_state, "param_groups": local_groups})
