"""A ``save_optimizer_state`` that a killed process or a failing writer cuts short never loses
the previous checkpoint (docs/design.md §9 and §15).

The previous checkpoint is written here; a subprocess per kill point loads it, changes every
state leaf and dies at that point of saving it again. Then this process loads what each left
(bitwise the state it saved, or the new one once the switch is done), makes the writer raise
at three points, and saves over everything once more.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gradsync_core import CheckpointError
from gradsync_core.checkpoint import save_hook
from gradsync_jax import load_optimizer_state, save_optimizer_state
from tests.faults import jax_save_worker as worker
from tests.support.asserts import assert_tree_equal

TIMEOUT_S = 120


def _leftover_kinds(path: Path) -> list[str]:
    current = os.readlink(path)
    return sorted(
        p.name[len(path.name) + 1 :].partition("-")[0] + "-"
        for p in path.parent.iterdir()
        if p.name.startswith(f"{path.name}.") and p.name != current
    )


def _check_loads(path: Path, tx: Any, params: Any, state: Any, step: int) -> None:
    loaded, manifest = load_optimizer_state(path, tx, params)
    assert manifest.step == step
    assert_tree_equal(
        tx.gather_state(loaded, params), tx.gather_state(state, params), same_structure=True
    )


def _fail_on_call(calls: int, error: int) -> Any:
    """An action that passes ``calls - 1`` times and then raises ``OSError(error)``."""
    seen = []

    def fail() -> None:
        seen.append(None)
        if len(seen) == calls:
            raise OSError(error, os.strerror(error))

    return fail


# Where a writer raises: (the save point, a factory of the action that raises there).
RAISE_POINTS = {
    "second rank file (disk full)": ("before_file", lambda: _fail_on_call(2, errno.ENOSPC)),
    "manifest (disk full)": ("before_manifest", lambda: _fail_on_call(1, errno.ENOSPC)),
    "switch (I/O error)": ("before_switch", lambda: _fail_on_call(1, errno.EIO)),
}


@pytest.mark.slow
def test_killed_and_failing_saves_keep_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tx, params = worker.problem()
    first = worker.bumped(tx.init(params), 2)
    paths = {point: tmp_path / point.replace(" ", "-") for point in worker.KILL_POINTS}
    for path in paths.values():
        save_optimizer_state(path, tx, first, params, step=1)
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    procs = {
        point: subprocess.Popen(
            [sys.executable, worker.__file__, str(path), point],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for point, path in paths.items()
    }
    for point, proc in procs.items():
        output = proc.communicate(timeout=TIMEOUT_S)[0]
        assert proc.returncode == worker.DIED, f"{point}: exit {proc.returncode}\n{output}"

    second = worker.bumped(first, 1)
    assert _leftover_kinds(paths["before the rank files"]) == ["tmp-"]
    assert _leftover_kinds(paths["between rank files"]) == ["tmp-"]
    assert _leftover_kinds(paths["before the switch"]) == ["v-"]  # complete, never linked
    assert _leftover_kinds(paths["after the switch"]) == ["v-"]  # the previous version
    for point, path in paths.items():
        if point == "after the switch":
            _check_loads(path, tx, params, second, step=2)
        else:
            _check_loads(path, tx, params, first, step=1)

    raised = tmp_path / "raised"
    save_optimizer_state(raised, tx, first, params, step=1)
    for point, (save_point, make_action) in RAISE_POINTS.items():
        with save_hook(save_point, make_action()):
            # The same error type on every process (CheckpointError); on the process that
            # failed, the writer's OSError is its cause.
            with pytest.raises(
                CheckpointError, match=r"No space left on device|Input/output error"
            ) as raised_error:
                save_optimizer_state(raised, tx, second, params, step=2)
            assert isinstance(raised_error.value.__cause__, OSError), point
        _check_loads(raised, tx, params, first, step=1)
        assert _leftover_kinds(raised) == [], point

    # The next save over each path succeeds and removes what the crashed saves left.
    for path in [raised, *paths.values()]:
        save_optimizer_state(path, tx, second, params, step=2)
        assert _leftover_kinds(path) == []
        _check_loads(path, tx, params, second, step=2)
