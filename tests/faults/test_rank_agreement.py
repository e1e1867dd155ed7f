"""Ranks that build or run DataParallel differently fail with one clear error on every rank
instead of hanging or averaging gradients of different steps
(docs/torch-data-parallel.md, "Runtime agreement"; docs/design.md §15).

One 2-rank gloo spawn runs every check of ``rank_agreement_checks`` under a process-group
timeout of a few seconds, so a regression that hangs fails the test instead of CI.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest

from gradsync_torch.data_parallel import DataParallelOptions
from tests.faults import rank_agreement_checks as checks
from tests.support.harness import run_checks, run_workers

PG_TIMEOUT_S = 10.0  # a collective that never completes fails after this
WORLD = 2


def test_every_option_is_covered() -> None:
    """A new DataParallel argument must be agreed (a DataParallelOptions field, with a value in
    DIFFERING_VALUES) or checked elsewhere."""
    options = set(checks.constructor_options())
    agreed = {field.name for field in dataclasses.fields(DataParallelOptions)}
    missing = options - agreed - set(checks.CHECKED_ELSEWHERE)
    assert not missing, (
        f"DataParallel arguments {sorted(missing)} are in no cross-rank check: add them to "
        "DataParallelOptions (gradsync_torch/data_parallel/options.py), which DataParallel "
        "compares at construction, and a differing value to DIFFERING_VALUES in "
        "tests/faults/rank_agreement_checks.py"
    )
    untested = agreed - set(checks.DIFFERING_VALUES)
    assert not untested, f"agreed options without a differing value: {sorted(untested)}"
    stale = (set(checks.DIFFERING_VALUES) | set(checks.CHECKED_ELSEWHERE)) - options
    assert not stale, f"not DataParallel arguments any more: {sorted(stale)}"


def _run_all(rank: int, ws: int) -> dict[str, str | None]:
    return run_checks(
        (name, functools.partial(check, rank, ws)) for name, check in checks.CHECKS.items()
    )


_results: list[dict[str, str | None]] = []


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_rank_agreement(check: str) -> None:
    if not _results:
        _results.extend(run_workers(_run_all, WORLD, timeout=240, pg_timeout_s=PG_TIMEOUT_S))
    for rank, outcome in enumerate(_results):
        assert outcome[check] is None, f"rank {rank}: {outcome[check]}"
