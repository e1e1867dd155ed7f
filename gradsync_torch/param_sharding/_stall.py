"""A collective some rank never reached, named in one sentence with its unit and rank.

See docs/torch-zero3.md, "Never a hang".

The runtime agreement (``_agreement.py``) needs every rank at a collective. A rank that left
the training loop (fewer batches, an early ``break``, a crash) is at none, so the others wait
until the process group's timeout, and the backend's error names neither the collective nor
the missing rank (gloo: "Timed out waiting 30000ms for recv operation to complete"). Then,
and only then, each rank that gave up writes what it waited in to the default process group's
store and reads what the group's other ranks wrote for ``GRACE_S`` seconds: the ranks that
wrote nothing never reached a ``fully_shard`` collective, and the ranks that wrote something
else were elsewhere (under HSDP, perhaps in a collective of another group). Nothing of this
runs while the collectives complete.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch.distributed as dist

from gradsync_torch._collectives import global_rank, peer_failed

GRACE_S = 10.0  # how long a rank that gave up waits for the others' reports
_KEY = "gradsync/fully_shard/stalled"
_STALLS = itertools.count()  # this process's stalls so far: the ranks' keys of one event


@contextmanager
def naming_stalls(what: str, group: Any) -> Iterator[None]:
    """Run the body (a wait on, or a call of, collective ``what`` over ``group``); a backend's
    report that a peer never completed it becomes ``stalled_error``'s sentence."""
    try:
        yield
    except RuntimeError as exc:  # DistError is one
        error = stalled_error(what, group, exc)
        if error is None:
            raise
        raise error from exc


def stalled_error(what: str, group: Any, cause: BaseException) -> RuntimeError | None:
    """The sentence for collective ``what`` over ``group`` that a peer never completed, or
    ``None`` if ``cause`` is not such a failure (it then propagates unchanged).

    Args:
        what: the collective, e.g. ``"all-gather #5 of unit 'layers.1' (4 parameters)"``.
        group: its process group.
        cause: what the backend raised.
    """
    if not peer_failed(cause):
        return None
    group = dist.group.WORLD if group is None else group
    ranks = [global_rank(group, r) for r in range(dist.get_world_size(group))]
    backend = str(cause).strip().splitlines()[0][-160:] if str(cause).strip() else repr(cause)
    reports = _reports(what, group, ranks)
    if reports is None:
        detail = (
            f"a rank of its group {ranks} never reached it or left it (which one could not be "
            "learnt: the process group's store is not reachable)"
        )
    else:
        detail = _describe(what, ranks, reports)
    return RuntimeError(
        f"fully_shard: {what} did not complete: {detail}; run the same number of steps, each "
        f"the same forward and backward, on every rank (backend: {backend})"
    )


def _describe(what: str, ranks: list[int], reports: dict[int, str]) -> str:
    missing = [r for r in ranks if r not in reports]
    here = [r for r in ranks if reports.get(r) == what]
    elsewhere = "".join(
        f"; rank {r} waited in {w} instead" for r, w in reports.items() if w != what
    )
    if not missing:
        return f"every rank of its group {ranks} gave up waiting (ranks {here} in it{elsewhere})"
    return (
        f"ranks {missing} of its group {ranks} never reached it (they reported no fully_shard "
        f"collective within {GRACE_S:g} s of the others' giving up: most often a rank left the "
        f"training loop early, took fewer steps, or died), while ranks {here} waited in it"
        f"{elsewhere}"
    )


def _reports(what: str, group: Any, ranks: list[int]) -> dict[int, str] | None:
    """What each rank of ``group`` that gave up waited in, by global rank (this one's
    included), as the default group's store holds them after ``GRACE_S`` seconds or once all
    reported; ``None`` if the store is not reachable."""
    try:
        # torch keeps the store init_process_group made here (private, but the only way to
        # reach it); one store for every group, so a rank waiting elsewhere is seen too.
        store = dist.distributed_c10d._get_default_store()
        stall = next(_STALLS)
        keys = {r: f"{_KEY}/{stall}/{r}" for r in ranks}
        store.set(keys[dist.get_rank()], what)
        deadline = time.monotonic() + GRACE_S
        while True:
            present = {r: key for r, key in keys.items() if store.check([key])}
            if len(present) == len(keys) or time.monotonic() > deadline:
                return {r: store.get(key).decode() for r, key in present.items()}
            time.sleep(0.05)
    except Exception:  # a failure while reporting a failure: report what is known
        return None
