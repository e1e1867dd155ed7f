"""``DataParallel`` under torch's ``Join``: 3 gloo ranks with 3, 4 and 5 batches end without a
hang and match DDP + ``Join`` bitwise (docs/torch-data-parallel.md, "Uneven inputs")."""

from __future__ import annotations

import functools

import pytest

from tests.support.harness import run_checks, run_workers
from tests.torch import join_checks as checks

WORLD = 3
_results: list[dict[str, str | None]] = []


def _run_all(rank: int, ws: int) -> dict[str, str | None]:
    return run_checks(
        (name, functools.partial(check, rank, ws)) for name, check in checks.CHECKS.items()
    )


@pytest.mark.parametrize("check", list(checks.CHECKS))
def test_join(check: str) -> None:
    if not _results:
        _results.extend(run_workers(_run_all, WORLD, timeout=240, pg_timeout_s=30.0))
    for rank, outcome in enumerate(_results):
        assert outcome[check] is None, f"rank {rank}: {outcome[check]}"
