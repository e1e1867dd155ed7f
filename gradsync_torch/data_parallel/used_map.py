"""The used-map: which parameters got a gradient on any rank in this sync (docs/design.md §7).

A parameter that got no gradient on some rank still takes part in its bucket's collective
(with zeros); afterwards a rank that lacked it must know whether *any* rank had one, to leave
the reduced value (someone had one) or ``None`` (nobody did, as in one process). Every rank
contributes one int per trainable parameter to a summing all-reduce per sync.

The map lives in a CPU tensor on a gloo group, never on the accelerator: building it from the
host's flags, reducing it and reading it back then involve no host-device synchronization, so
a training step never waits for the GPU (docs/torch-data-parallel.md, "No host-device
synchronization"). With a gloo data-parallel group the map reuses it; otherwise
(``bookkeeping_group``) a gloo group over the same ranks is created once, at construction.

The map is the one bookkeeping collective of a step, and the runtime agreement check rides at
its end (``sync_agreement.py``: a few ints per sync saying how each rank reached it), so every
rank reads the reduced tail in every sync. That read waits for a small CPU collective the
other ranks issue at the same point of their step; it never touches the accelerator.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from gradsync_torch.data_parallel.sync_agreement import (
    NUM_INTS,
    SyncRecord,
    disagree,
    disagreement_error,
    encode,
)


def bookkeeping_group(group: dist.ProcessGroup) -> dist.ProcessGroup:
    """A gloo group over ``group``'s ranks for small CPU collectives (``group`` if it is gloo).

    Called once per ``DataParallel``, by ``group``'s members only
    (``use_local_synchronization``), so ranks of other data-parallel groups need not join.
    """
    if "gloo" in str(dist.get_backend(group)):
        return group
    ranks = dist.get_process_group_ranks(group)
    return dist.new_group(ranks, backend="gloo", use_local_synchronization=True)


class UsedMap:
    """The per-sync all-reduce of the used flags, on CPU tensors over a gloo group.

    Args:
        group: a gloo group over the data-parallel ranks (``bookkeeping_group``).
    """

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.world_size = group.size()
        self._counts: torch.Tensor | None = None
        self._work: Any = None  # the collective of the latest start(), until settled
        self._record: SyncRecord | None = None  # this rank's record in the latest start()
        self._joined = False  # the latest start() shadowed the others' sync (Join)
        self._active = self.world_size  # ranks that sent a record to the latest start()

    def start(
        self,
        flags: list[bool],
        record: SyncRecord | None = None,
        *,
        joined: bool = False,
        active: int | None = None,
    ) -> None:
        """Begin summing ``flags`` (this rank's "had a gradient" per slot) over the ranks,
        followed by ``record`` (how this rank reached the sync) for ``check_agreement``.

        Under ``Join`` (``join.py``): ``joined``, this rank ran out of batches and shadows
        the sync, sending zeros in place of a record; ``active``, how many ranks have not
        joined (every rank knows it from the join status of this step).
        """
        self.settle()
        self._record = record if self.world_size > 1 else None
        self._joined = joined and self.world_size > 1
        self._active = self.world_size if active is None else active
        extra: list[int] | tuple[()] = ()
        if self._joined:
            extra = [0] * NUM_INTS  # adds nothing to either sum of the check
        elif self._record is not None:
            extra = encode(self._record)
        # int64: the agreement ints carry squares up to 2**40 (sync_agreement.py).
        self._counts = torch.tensor([*flags, *extra], dtype=torch.int64)
        if self.world_size > 1:
            self._work = dist.all_reduce(self._counts, group=self.group, async_op=True)

    def counts(self) -> torch.Tensor:
        """Per slot, how many ranks had a gradient, then the summed ``extra`` (waits for the
        collective; CPU only)."""
        self.settle()
        if self._counts is None:
            raise RuntimeError("UsedMap.counts() called before start(): no sync is in progress")
        return self._counts

    def check_agreement(self) -> None:
        """Raise on every rank if the ranks sent different records to this sync (waits for the
        collective; CPU only). Every rank must call it after every ``start`` with a record.

        Raises:
            RuntimeError: naming the ranks and what each did since the previous sync.
        """
        if self._record is None and not self._joined:
            return
        sums = self.counts()[-NUM_INTS:].tolist()
        if disagree(sums, self._active):
            raise disagreement_error(self._record, self.group)

    def settle(self) -> None:
        """Wait for the latest collective if nobody did (a rank that needed no counts)."""
        if self._work is not None:
            work, self._work = self._work, None
            work.wait()

    def broadcast_order(self, order: list[int], num_slots: int, src: int) -> list[int]:
        """Rank ``src``'s ``order`` (slots, at most ``num_slots``) on every rank, over the
        same gloo group (the rebuild's ready order: CPU only, as the map)."""
        self.settle()
        padded = torch.full((num_slots,), -1, dtype=torch.int64)
        if order:
            padded[: len(order)] = torch.tensor(order, dtype=torch.int64)
        if self.world_size > 1:
            dist.broadcast(padded, src=src, group=self.group)
        return [slot for slot in padded.tolist() if slot >= 0]
