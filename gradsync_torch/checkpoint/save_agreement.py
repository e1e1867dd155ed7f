"""The collectives of a checkpoint save or load on a torch process group (docs/design.md §9).

``gradsync_core.checkpoint.run_save`` runs the switching save on any executor through its
``SaveAgreement``; this is torch's: the failure agreement is ``gradsync_torch.agreement.
agree_ok`` (the one cross-rank primitive), the token a broadcast from group rank 0, the
gather an ``all_gather_object``. Every verb is a no-op without a process group.

A save with ``blocking=False`` runs its agreement in a background thread while training goes
on; collectives from two threads on one process group can pair up wrongly across ranks (rank
0's save gather meeting rank 1's gradient all-reduce). So that thread agrees over a gloo group
of its own (``background_ranks``), made collectively by the save's ranks at their first such
save (``new_group(..., use_local_synchronization=True)``: only those ranks take part, as only
they call the save) with the training group's timeout, and kept for every later one. It is
gloo whatever the training backend (the agreement moves small host objects), as torch DCP's
``async_save`` needs a CPU backend for the same reason.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync_core.checkpoint import CheckpointError
from gradsync_torch._collectives import all_gather_single, global_rank
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
        except RuntimeError as failure:  # the collective itself broke
            raise _broken(failure) from failure

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
        return _gather_objects(record, self.ranks.process_group, self.ranks.world_size)


# The bytes of a rank's answer that travel in the first all-gather: a save's answers (an
# error sentence, the token, the rank files' digests and the manifest's record) fit, so each
# of its agreements is one collective; a longer answer sends the rest in a second.
SLOT_BYTES = 4096
_LENGTH_BYTES = 8


def _gather_objects(value: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's ``value`` (pickled, as ``all_gather_object`` does), in group-rank order:
    one all-gather of ``SLOT_BYTES`` a rank, and a second only when some answer is longer
    (every rank reads every length from the first, so all make the second alike)."""
    data = pickle.dumps(value)
    slot = np.zeros(_LENGTH_BYTES + SLOT_BYTES, np.uint8)
    slot[:_LENGTH_BYTES] = np.frombuffer(np.int64(len(data)).tobytes(), np.uint8)
    head = np.frombuffer(data[:SLOT_BYTES], np.uint8)
    slot[_LENGTH_BYTES : _LENGTH_BYTES + head.size] = head
    rows = _all_gather_bytes(slot, group, world_size)
    lengths = rows[:, :_LENGTH_BYTES].copy().view(np.int64).reshape(-1).tolist()
    answers = [
        rows[r, _LENGTH_BYTES:][: min(n, SLOT_BYTES)].tobytes() for r, n in enumerate(lengths)
    ]
    longest = max(lengths)
    if longest > SLOT_BYTES:
        rest = np.zeros(longest - SLOT_BYTES, np.uint8)
        tail = np.frombuffer(data[SLOT_BYTES:], np.uint8)
        rest[: tail.size] = tail
        tails = _all_gather_bytes(rest, group, world_size)
        for r, n in enumerate(lengths):
            answers[r] += tails[r, : max(n - SLOT_BYTES, 0)].tobytes()
    return [pickle.loads(answer) for answer in answers]


def _all_gather_bytes(mine: np.ndarray, group: Any, world_size: int) -> np.ndarray:
    """Every rank's ``mine`` (uint8, one length on every rank), as the rows of an array; on
    the GPU for NCCL, which moves CUDA tensors only."""
    tensor = torch.from_numpy(mine)
    if "nccl" in str(dist.get_backend(group)):
        tensor = tensor.to(torch.device("cuda", torch.cuda.current_device()))
    every = torch.empty(world_size * tensor.numel(), dtype=torch.uint8, device=tensor.device)
    all_gather_single(every, tensor, group=group)
    return every.cpu().numpy().reshape(world_size, -1)


def _broken(failure: RuntimeError) -> RuntimeError:
    """A background save's collective that broke because the process group was destroyed
    meanwhile says so (the fix is the user's); any other break is passed on."""
    if dist.is_initialized():
        return failure
    return RuntimeError(
        f"the process group was destroyed while the save was writing ({failure}); call "
        "wait() on the save's handle, or gradsync_core.wait_for_saves(), before "
        "destroy_process_group()"
    )


# The gloo group of the background saves of each training group, by its global ranks.
_background_groups: dict[tuple[int, ...], Any] = {}


def _timeout(group: Any) -> datetime.timedelta | None:
    """The collective timeout of ``group`` (so a dead peer is noticed as fast as training
    notices it); ``None``: torch's default."""
    pg: Any = dist.group.WORLD if group is None else group
    for device in ("cpu", "cuda"):
        try:
            timeout = pg._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError, ValueError):
            continue
        if isinstance(timeout, datetime.timedelta):
            return timeout
    return None


def background_ranks(ranks: RankGroup) -> RankGroup:
    """``ranks`` over the gloo group that saves in the background agree on (a collective over
    the group's ranks the first time, made then and kept; later calls are free)."""
    if ranks.world_size == 1:
        return ranks
    members = tuple(dist.get_process_group_ranks(ranks.process_group or dist.group.WORLD))
    group = _background_groups.get(members)
    if group is not None:
        try:
            dist.get_process_group_ranks(group)  # still registered: not destroyed since
        except (ValueError, RuntimeError):
            group = None
    if group is None:
        group = dist.new_group(
            list(members),
            timeout=_timeout(ranks.process_group),
            backend="gloo",
            use_local_synchronization=True,
            group_desc="gradsync_background_saves",
            sort_ranks=False,  # group rank r is the training group's rank r
        )
        _background_groups[members] = group
    return RankGroup(group, ranks.rank, ranks.world_size)
