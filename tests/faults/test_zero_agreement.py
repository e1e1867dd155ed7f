"""ZeroRedundancyOptimizer ranks that disagree on the optimizer, or load a forged checkpoint,
fail with one sentence on every rank and leave every rank's state untouched (issue 21 items 4
and 5; docs/design.md §15).

One 2-rank gloo spawn runs every check of ``zero_agreement_checks`` under a process-group
timeout of a few seconds, so a regression that hangs fails the test instead of CI.
"""

from __future__ import annotations

import functools

import pytest

from tests.faults import zero_agreement_checks as checks
from tests.support.harness import run_checks, run_workers

PG_TIMEOUT_S = 10.0  # a collective that never completes fails after this
WORLD = 2


def _run_all(rank: int, ws: int) -> dict[str, str | None]:
    return run_checks(
        (name, functools.partial(check, rank, ws)) for name, check in checks.CHECKS.items()
    )


_results: list[dict[str, str | None]] = []


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_zero_agreement(check: str) -> None:
    if not _results:
        _results.extend(run_workers(_run_all, WORLD, timeout=240, pg_timeout_s=PG_TIMEOUT_S))
    for rank, outcome in enumerate(_results):
        assert outcome[check] is None, f"rank {rank}: {outcome[check]}"
