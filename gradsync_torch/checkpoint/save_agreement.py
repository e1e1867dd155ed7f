"""The collectives of a checkpoint save or load on a torch process group (docs/design.md §9).

``gradsync_core.checkpoint.run_save`` runs the switching save on any executor through its
``SaveAgreement``; this is torch's: the failure agreement is ``gradsync_torch.agreement.
agree_ok`` (the one cross-rank primitive), the token a broadcast from group rank 0, the
gather an ``all_gather_object``. Every verb is a no-op without a process group.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradsync_core.checkpoint import CheckpointError
from gradsync_torch._collectives import global_rank
from gradsync_torch._optim_state import RankGroup
from gradsync_torch.agreement import agree_ok


class RankSaveAgreement:
    """``SaveAgreement`` over the ranks of ``ranks`` (group rank 0 leads)."""

    def __init__(self, ranks: RankGroup) -> None:
        self.ranks = ranks

    @property
    def leader(self) -> bool:
        """Whether this rank opens the staging directory and writes the manifest."""
        return self.ranks.rank == 0

    @property
    def who(self) -> str:
        """``"rank 1"``: this rank's global rank, as errors name it."""
        return f"rank {global_rank(self.ranks.process_group, self.ranks.rank)}"

    def all_ok(self, error: str | None, what: str) -> None:
        """Raise the first failing rank's ``error`` as ``CheckpointError`` on every rank."""
        if self.ranks.world_size == 1:
            # Alone (a plain optimizer's load on rank 0 of a running job): agree_ok's group
            # None is the whole world, which would wait for ranks that never come.
            if error is not None:
                raise CheckpointError(f"{what}: {error}")
            return
        try:
            agree_ok(error, self.ranks.process_group, what=what)
        except ValueError as failure:
            raise CheckpointError(str(failure)) from None

    def share_token(self, token: str | None) -> str:
        """Group rank 0's save token, on every rank."""
        shared = [token]
        if self.ranks.world_size > 1:
            src = global_rank(self.ranks.process_group, 0)
            dist.broadcast_object_list(shared, src=src, group=self.ranks.process_group)
        assert shared[0] is not None  # rank 0 failed to make one: all_ok raised before
        return shared[0]

    def gather(self, record: Any) -> list[Any]:
        """Every rank's ``record``, in group-rank order, on every rank."""
        if self.ranks.world_size == 1:
            return [record]
        gathered: list[Any] = [None] * self.ranks.world_size
        dist.all_gather_object(gathered, record, group=self.ranks.process_group)
        return gathered
