"""A ZeroRedundancyOptimizer save that a killed rank or a failing writer cuts short never
loses the previous checkpoint (docs/design.md §9 and §15).

One 2-rank spawn per kill point (a rank ``os._exit``s at that point of the second save, the
other must notice within the process-group timeout), then one spawn that loads what each left,
makes the writer raise at four points of a save, and saves over everything once more.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.faults import torch_save_faults as faults
from tests.support.harness import run_workers, run_workers_outcomes

PG_TIMEOUT_S = 5.0  # a rank waiting for a dead peer gives up after this
WORLD = 2


def _kill(directory: Path, point: str) -> tuple[str, str, list[object]]:
    path = str(directory / point.replace(" ", "-"))
    outcomes = run_workers_outcomes(
        faults.crash_during_save, WORLD, path, point, timeout=60, pg_timeout_s=PG_TIMEOUT_S
    )
    return point, path, outcomes


@pytest.mark.slow
def test_killed_and_failing_saves_keep_the_previous_checkpoint(tmp_path: Path) -> None:
    # The kill spawns are independent: two at a time keep both cores busy while a survivor
    # waits for gloo to report its dead peer.
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda p: _kill(tmp_path, p), faults.KILL_POINTS))
    killed = {}
    for point, path, outcomes in runs:
        dying = faults.KILL_POINTS[point][0]
        assert outcomes[dying].exitcode == faults.DIED, f"{point}: {outcomes[dying]}"
        survivor = outcomes[1 - dying]
        assert survivor.error is None and survivor.exitcode == 0, f"{point}: {survivor}"
        # The survivor hears of it from gloo (connection closed) or its timeout, never hangs.
        assert survivor.value["raised"] is not None, f"{point}: the survivor's save returned"
        assert survivor.value["seconds"] < PG_TIMEOUT_S + 5, f"{point}: {survivor.value}"
        killed[point] = path

    result = run_workers(faults.check_after_faults, WORLD, killed, str(tmp_path), timeout=120)[0]
    assert sorted(result["messages"]) == sorted(faults.RAISE_POINTS)
    # The crashed saves did leave directories beside the path (then removed by the next save):
    # staging ones before the switch, the superseded version after it.
    left = result["left by the killed saves"]
    assert left["before its rank file"] == ["tmp-"], left
    assert left["after its rank file"] == ["tmp-"], left
    assert left["before the manifest"] == ["tmp-"], left
    assert left["before the switch"] == ["v-"], left  # complete, but never linked
    assert left["after the switch"] == ["v-"], left  # the previous version, not yet removed
    for path in killed.values():
        assert os.path.islink(path)
