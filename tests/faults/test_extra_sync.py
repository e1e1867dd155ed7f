"""Without ``Join``, a rank that syncs once more than the others ends within the process-group
timeout with one sentence naming the cause, not a bare backend timeout
(docs/torch-data-parallel.md, "Uneven inputs")."""

from __future__ import annotations

import time

from tests.faults.extra_sync_worker import extra_sync
from tests.torch.harness import run_workers_outcomes

PG_TIMEOUT_S = 5.0


def test_extra_sync_names_the_cause() -> None:
    start = time.monotonic()
    short, extra = run_workers_outcomes(
        extra_sync, 2, "barrier", timeout=90, pg_timeout_s=PG_TIMEOUT_S
    )
    assert time.monotonic() - start < 90
    assert extra.exitcode == 0 and extra.error is None, extra
    assert extra.value.startswith("DataParallel: gradient sync #2 did not complete"), extra.value
    assert "another rank of the group never reached it" in extra.value
    assert "model.join()" in extra.value
    # The rank that stopped early is in the user's own barrier, which ends with torch's error.
    assert short.exitcode == 0 and short.value != "no error", short
