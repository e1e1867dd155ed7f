"""Cross-rank agreement: the one primitive every torch check is built on (docs/design.md §8).

A rank that builds a different model, plan or optimizer would otherwise hang in the first
mismatched collective, or silently train garbage when the sizes happen to line up. Two verbs,
both collectives over one group, both raising the **same** ``ValueError`` on every rank:

- ``agree_on(payload, group, describe=...)``: one all-gather of a 32-byte digest of the
  payload's canonical JSON, so agreement costs one tiny collective; only on a mismatch are the
  full payloads gathered, and ``describe`` turns the first difference into the sentence.
- ``agree_ok(error, group, what=...)``: every rank says whether its local step worked; the
  first failure is raised everywhere, so no rank walks on into a collective that a failed rank
  never reaches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import gradsync_core
from gradsync_torch._collectives import all_gather_single, global_rank


class Disagreement(NamedTuple):
    """What ``describe`` gets when the payloads differ: group rank 0's payload, the first
    differing rank's payload (or their ``detail``), and the global ranks on each side."""

    base: Any
    other: Any
    base_rank: int
    other_rank: int
    agreeing: list[int]  # global ranks whose payload equals rank 0's
    differing: list[int]  # global ranks whose payload differs


def _group_size(group: Any) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def _digest_device(group: Any) -> torch.device:
    # NCCL moves CUDA tensors only; every other backend here takes CPU tensors.
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on(
    payload: Any,
    group: Any,
    *,
    describe: Callable[[Disagreement], str],
    device: torch.device | None = None,
    detail: Any = None,
) -> None:
    """Raise the same ``ValueError`` on every rank of ``group`` unless all payloads are equal.

    Args:
        payload: a JSON-able value (dicts, lists, strings, numbers) describing what must agree.
        group: the process group (``None``: the world).
        describe: builds the error sentence from the first disagreement.
        device: where the digest travels (default: CUDA for NCCL, else CPU).
        detail: what is gathered for ``describe`` on a mismatch instead of the payload (say,
            the parameter table behind a plan's fingerprint); ``None``: the payload.

    Raises:
        ValueError: ``describe``'s sentence, on every rank, when any payload differs.
    """
    world_size = _group_size(group)
    if world_size == 1:
        return
    canonical = gradsync_core.canonical_json(payload).encode("utf-8")
    digest = hashlib.sha256(canonical).digest()
    device = device or _digest_device(group)
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    gathered = torch.empty(world_size * len(digest), dtype=torch.uint8, device=device)
    all_gather_single(gathered, mine, group=group)
    rows = [bytes(row) for row in gathered.view(world_size, -1).cpu().tolist()]
    if all(row == rows[0] for row in rows):
        return
    payloads: list[Any] = [None] * world_size
    dist.all_gather_object(payloads, payload if detail is None else detail, group=group)
    ranks = [global_rank(group, r) for r in range(world_size)]
    first = next(r for r in range(world_size) if rows[r] != rows[0])
    raise ValueError(
        describe(
            Disagreement(
                base=payloads[0],
                other=payloads[first],
                base_rank=ranks[0],
                other_rank=ranks[first],
                agreeing=[ranks[r] for r in range(world_size) if rows[r] == rows[0]],
                differing=[ranks[r] for r in range(world_size) if rows[r] != rows[0]],
            )
        )
    )


def agree_ok(error: str | None, group: Any, *, what: str) -> None:
    """Raise the first failing rank's ``error`` on every rank of ``group`` (a collective).

    Args:
        error: this rank's failure as one sentence, or ``None`` when its step worked.
        group: the process group (``None``: the world).
        what: what was attempted, the sentence's subject ("cannot save checkpoint /x").

    Raises:
        ValueError: ``"{what} (rank R): {error}"`` on every rank when any rank failed.
    """
    world_size = _group_size(group)
    errors: list[Any] = [error]
    if world_size > 1:
        errors = [None] * world_size
        dist.all_gather_object(errors, error, group=group)
    failed = [(r, e) for r, e in enumerate(errors) if e is not None]
    if failed:
        rank, message = failed[0]
        where = f" (rank {global_rank(group, rank)})" if world_size > 1 else ""
        raise ValueError(f"{what}{where}: {message}")
