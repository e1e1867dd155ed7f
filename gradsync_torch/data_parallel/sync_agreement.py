"""Runtime agreement: every sync checks that all ranks reached it the same way (docs/design.md §7).

Construction checks (``setup.verify_same_everywhere``) catch ranks that build different models
or options. They cannot catch ranks that *run* differently: one rank doing an extra backward,
entering ``no_sync()`` alone, or accumulating a different number of micro-steps. Syncs are then
paired off by position, so the ranks average gradients of different steps without any error, until
a later mismatch hangs (DDP behaves the same unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL``).

Each rank therefore describes how it reached this sync (``SyncRecord``) in a few ints that ride
at the end of the used-map, the summing all-reduce every sync runs anyway: no extra
collective. A sum cannot say *who* sent what, but it can say whether everybody sent the same:
each field ``v`` travels as ``v`` and ``v * v``, and for ``n`` ranks
``n * sum(v * v) == sum(v) ** 2`` holds exactly when every rank sent the same ``v``
(Cauchy-Schwarz, with equality only for equal terms). Every rank reads the same sums, so
every rank detects a disagreement at the same sync; only then do they gather the full records
(one ``all_gather_object`` on the same group) to name the ranks and what each did.

Fields are kept below ``FIELD_LIMIT`` (2**20) so that ``v * v`` summed over up to 2**23 ranks
fits in the map's int64.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.distributed as dist

import gradsync_core

FIELD_LIMIT = 1 << 20


class SyncRecord(NamedTuple):
    """How this rank reached a sync; every rank of the group must send the same record."""

    sync: int  # syncs this wrapper completed before this one
    layout: int  # the bucket layout's fingerprint (a different wrapper or plan pairs here)
    forwards: int  # grad-enabled forwards since the previous sync
    backwards: int  # backwards that reached the model since the previous sync, this one too
    # 1: the backward accumulated onto the gradients the previous sync left (no zero_grad in
    # between, as in a second backward of the same step); 0: they were cleared
    accumulated: int

    def describe(self) -> str:
        """What this rank did, for the error message."""
        grads = "kept from the previous sync" if self.accumulated else "cleared since it"
        backwards = "?" if self.backwards < 0 else str(self.backwards)
        return (
            f"sync #{self.sync}, {self.forwards} forward(s) and {backwards} backward(s) since "
            f"the previous sync, gradients {grads}, layout {self.layout:05x}"
        )


def layout_fingerprint(plan: gradsync_core.BucketPlan) -> int:
    """A small int naming the bucket layout (which parameter sits where), below FIELD_LIMIT."""
    digest = hashlib.sha256(gradsync_core.canonical_json(plan.to_json()).encode("ascii"))
    return int.from_bytes(digest.digest()[:4], "big") % FIELD_LIMIT


def encode(record: SyncRecord) -> list[int]:
    """The ints this rank appends to the used-map: ``v`` and ``v * v`` per field."""
    out = []
    for value in record:
        # A count past the limit wraps (backwards of -1, "not counted", becomes the limit - 1):
        # ranks that agree still send equal values.
        value %= FIELD_LIMIT
        out += [value, value * value]
    return out


NUM_INTS = 2 * len(SyncRecord._fields)


def disagree(sums: Sequence[int], world_size: int) -> bool:
    """Whether the summed ``encode`` of ``world_size`` ranks came from different records.

    Under ``Join`` a joined rank sends zeros (it adds nothing to either sum), so
    ``world_size`` is then the number of ranks that have not joined.
    """
    return any(world_size * sums[i + 1] != sums[i] * sums[i] for i in range(0, len(sums), 2))


def disagreement_error(
    mine: SyncRecord | None, group: dist.ProcessGroup, *, what: str = "DataParallel"
) -> RuntimeError:
    """Gather every rank's record (all ranks call this together) and describe who did what;
    ``mine`` is ``None`` on a rank that joined (ran out of batches under ``Join``)."""
    records: list[tuple[int, ...] | None] = [None] * group.size()
    dist.all_gather_object(records, None if mine is None else tuple(mine), group=group)
    by_record: dict[SyncRecord | None, list[int]] = {}
    for r, rec in enumerate(records):
        record = None if rec is None else SyncRecord(*rec)
        by_record.setdefault(record, []).append(dist.get_global_rank(group, r))
    did = "; ".join(
        f"ranks {ranks}: " + ("joined (out of batches)" if record is None else record.describe())
        for record, ranks in by_record.items()
    )
    return RuntimeError(
        f"{what}: the ranks reached this gradient sync differently, so their gradients would "
        f"be averaged across different steps ({did}); run the same forwards and backwards on "
        "every rank between syncs (same no_sync() use, same number of accumulation "
        "micro-steps, zero_grad at the same points)"
    )


class SyncHistory:
    """What this rank did since its previous sync: the wrapper's side of a ``SyncRecord``.

    Whether the gradients were cleared between two syncs is read from one probe parameter:
    ``zero_grad(set_to_none=True)`` clears every gradient at once, and autograd accumulates
    into an existing gradient in place, so the probe's ``.grad`` is still the very tensor the
    previous sync left there exactly when nothing cleared it. One identity check per forward
    and per sync keeps this off the per-parameter hot path.

    Args:
        probe: a trainable parameter of the model (``None`` if it has none).
    """

    def __init__(self, probe: torch.Tensor | None) -> None:
        self.probe = probe
        self.forwards = 0
        self.local_backwards = 0  # finished backwards under no_sync() since the previous sync
        self._kept: torch.Tensor | None = None  # the probe's gradient as the last sync left it

    def _note_cleared(self) -> None:
        if self._kept is not None and self.probe is not None and self.probe.grad is not self._kept:
            self._kept = None

    def note_forward(self) -> None:
        """A grad-enabled forward ran (before gradient views are bound again)."""
        self.forwards += 1
        self._note_cleared()

    def record(self, *, sync: int, layout: int, backwards: int) -> SyncRecord:
        """This rank's record for the sync about to run; ``backwards`` -1: not counted."""
        self._note_cleared()
        return SyncRecord(sync, layout, self.forwards, backwards, int(self._kept is not None))

    def synced(self) -> None:
        """A sync completed: start counting anew."""
        self.forwards = self.local_backwards = 0
        self._kept = None if self.probe is None else self.probe.grad
