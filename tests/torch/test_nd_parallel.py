"""Every parallelism at once on the Llama reference, 8 gloo ranks (issue 37).

One spawn of 8 ranks runs every check of ``nd_checks`` (spawns cost seconds): the four
compositions of the issue, each trained 4 steps with AdamW and clipping against the
single-process model (parameters and AdamW moments, within the float32 reduction-order floor
stated in ``nd_checks``); the runtime agreement (a rank with another topology or another
model gets one sentence); the compositions ``parallelize`` refuses.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from tests.support.harness import run_checks, run_workers
from tests.torch import nd_checks as checks

CHECKS = [*checks.COMPOSITIONS, "agreement", "refusals"]


def run_all(rank: int, ws: int, directory: str) -> dict[str, str | None]:
    named = [
        (name, functools.partial(checks.check_composition, rank, ws, name, directory))
        for name in checks.COMPOSITIONS
    ]
    named += [
        ("agreement", functools.partial(checks.check_agreement, rank, ws)),
        ("refusals", functools.partial(checks.check_refusals, rank, ws)),
    ]
    return run_checks(named, keep_going=True)


_results: list[dict[str, str | None]] = []


@pytest.fixture(scope="module")
def figures(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where each composition writes its largest differences."""
    return tmp_path_factory.mktemp("nd-parallel")


def _outcomes(directory: Path) -> list[dict[str, str | None]]:
    if not _results:
        _results.extend(run_workers(run_all, 8, str(directory), timeout=600))
    return _results


@pytest.mark.slow
@pytest.mark.parametrize("check", CHECKS)
def test_nd_parallel(check: str, figures: Path) -> None:
    outcomes = _outcomes(figures)
    for rank, outcome in enumerate(outcomes):
        assert check in outcome, f"check {check} did not run on rank {rank}"
    # The ranks' own failures first ("passed here, failed on another rank" says nothing).
    errors = [(rank, o[check]) for rank, o in enumerate(outcomes) if o[check] is not None]
    errors.sort(key=lambda e: str(e[1]).startswith("passed here"))
    assert not errors, f"rank {errors[0][0]} of 8: {errors[0][1]}"
    if check in checks.COMPOSITIONS:
        worst = json.loads((figures / f"{check}.json").read_text())
        print(f"{check}: max abs difference {worst}")
