"""Where a ZeRO rank's optimizer state lives: the ``Layout`` protocol and the choice of layout.

Two layouts, both driven by gradsync_core plans (ZeRO, arXiv:1910.02054):

- ``GreedyLayout`` (ZeRO-1, in ``zero.greedy``): each rank owns whole parameters
  (``plan_greedy_shards``); its local optimizer steps the real parameters; afterwards every
  rank's parameters are broadcast from their owner.
- ``FlatLayout`` (ZeRO-2, in ``zero.flat``): each rank owns one contiguous element range of
  every padded bucket (``plan_flat_shards``); gradients are reduce-scattered into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from gradsync_core import ParamSpec, ShardPlan
from gradsync_torch.data_parallel import ReduceScatter
from gradsync_torch.zero.broadcast import Broadcaster, Job, Piece
from gradsync_torch.zero.flat import FlatLayout
from gradsync_torch.zero.greedy import GreedyLayout


class Layout(Protocol):
    """What the optimizer needs from a layout (docs/design.md §9).

    ``pieces`` are what the local optimizer steps, in model space (parameter index and
    element range); ``before_step`` gives them this step's gradients; ``sync_params`` runs
    the broadcast ``jobs`` that make every replica's parameters equal again (stepping each
    job's ``owned`` pieces first when given a ``step``).
    """

    plan: ShardPlan
    pieces: list[Piece]
    jobs: list[Job]

    @property
    def grad_nbytes(self) -> int: ...

    def before_step(self) -> None: ...

    def sync_params(self, step: Callable[[Job], None] | None = None) -> None: ...


def make_layout(
    params: Sequence[torch.Tensor],
    groups: Sequence[int],
    specs: Sequence[ParamSpec],
    plan: ShardPlan,
    broadcaster: Broadcaster,
    *,
    flat: bool,
    sharder: ReduceScatter | None,
    cap_bytes: int,
    bucket_view: bool,
) -> Layout:
    """The layout for ``plan``: greedy (ZeRO-1), flat on its own, or flat over the buckets
    of a sharding DataParallel (whose slots carry the module's names: mapped to ours)."""
    if not flat:
        return GreedyLayout(
            params, groups, specs, plan, broadcaster, cap_bytes=cap_bytes, bucket_view=bucket_view
        )
    slot_params = {s.name: p for s, p in zip(specs, params, strict=True)}
    if sharder is not None:
        ours = {id(p): s.name for s, p in zip(specs, params, strict=True)}
        slot_params = {ours.get(id(p), n): p for n, p in sharder.params_by_name().items()}
    return FlatLayout(
        slot_params,
        {s.name: i for i, s in enumerate(specs)},
        groups,
        plan,
        broadcaster,
        bucket_view=bucket_view,
        sharder=sharder,
    )
