"""Faults while a JAX ``save_optimizer_state(blocking=False)`` writes in the background
(docs/design.md §9 and §15): a killed process, a full disk (raised at ``wait()``, and at the
next save when nobody waited), a raising writer, a second save, an interpreter that exits with
the save in flight.

In every case the previous checkpoint still loads bitwise at another device count (8, saved
on 4) and in the other framework (a plain torch Adam at world size 1). Killed and exiting
processes are subprocesses (tests/faults/async_jax_worker.py); the rest runs here.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest

from gradsync_core import CheckpointError, wait_for_saves
from gradsync_core.checkpoint import SAVE_FAILED_EXIT, save_hook
from gradsync_jax import load_optimizer_state, save_optimizer_state, shard_optimizer
from tests.faults import async_jax_worker as worker
from tests.faults.jax_save_worker import DIED, bumped, problem
from tests.jax.async_save_problem import optax_moments, torch_moments
from tests.support.meshes import mesh_of

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


def assert_loads_everywhere(path: Path, tx: Any, params: Any, state: Any, step: int) -> None:
    """``path`` holds ``state`` bitwise: loaded on 8 devices, and in a plain torch Adam."""
    eight = shard_optimizer(optax.adam(1e-2), mesh_of(8))
    loaded, manifest = load_optimizer_state(path, eight, params)
    assert manifest.step == step
    want = jax.tree.map(np.asarray, tx.gather_state(state, params))
    got = jax.tree.map(np.asarray, eight.gather_state(loaded, params))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.array_equal(a, b)
    moments = optax_moments(want[0])
    in_torch = torch_moments(str(path))
    assert sorted(in_torch) == sorted(moments)
    for key, value in moments.items():
        assert np.array_equal(in_torch[key], value), key


def _run_worker(path: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, worker.__file__, str(path), mode],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.fixture(autouse=True)
def _no_save_left() -> Any:
    yield
    try:
        wait_for_saves()
    except CheckpointError:
        pass


@pytest.mark.slow
def test_a_process_killed_during_the_background_write_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    tx, params = problem()
    first = bumped(tx.init(params), 2)
    points = ("before_file", "before_switch")
    paths = {point: tmp_path / point for point in points}
    for path in paths.values():
        save_optimizer_state(path, tx, first, params, step=1)
    procs = {point: _run_worker(path, f"die-{point}") for point, path in paths.items()}
    for point, proc in procs.items():
        _, err = proc.communicate(timeout=TIMEOUT_S)
        assert proc.returncode == DIED, f"{point}: {proc.returncode}\n{err}"
    for path in paths.values():
        assert_loads_everywhere(path, tx, params, first, step=1)


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_failures_in_the_background_are_raised_and_keep_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    tx, params = problem()
    first, second = bumped(tx.init(params), 2), bumped(tx.init(params), 3)
    path = tmp_path / "ckpt"
    save_optimizer_state(path, tx, first, params, step=1)
    sentence = (
        f"cannot save optimizer checkpoint {path}: process 0 could not write its file: "
        "OSError: [Errno 28] No space left on device"
    )
    with save_hook("before_file", _disk_full):
        handle = save_optimizer_state(path, tx, second, params, step=2, blocking=False)
        with pytest.raises(CheckpointError) as raised:
            handle.wait(timeout=60)
        assert str(raised.value) == sentence
        assert isinstance(raised.value.__cause__, OSError)
        # Nobody waits: the next save raises it, and does not start.
        save_optimizer_state(path, tx, second, params, step=2, blocking=False)
        with pytest.raises(CheckpointError, match="No space left on device"):
            save_optimizer_state(path, tx, second, params, step=3)
    assert_loads_everywhere(path, tx, params, first, step=1)

    with save_hook("after_file", lambda: (_ for _ in ()).throw(RuntimeError("the writer broke"))):
        handle = save_optimizer_state(path, tx, second, params, step=2, blocking=False)
        with pytest.raises(CheckpointError, match="RuntimeError: the writer broke"):
            handle.wait(timeout=60)
    assert_loads_everywhere(path, tx, params, first, step=1)


def test_a_second_save_waits_for_the_one_writing(tmp_path: Path) -> None:
    tx, params = problem()
    first, second = bumped(tx.init(params), 2), bumped(tx.init(params), 3)
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(10)):
        handle = save_optimizer_state(tmp_path / "a", tx, first, params, step=1, blocking=False)
        threading.Timer(1.0, release.set).start()
        start = time.monotonic()
        later = save_optimizer_state(tmp_path / "b", tx, second, params, step=2, blocking=False)
        waited = time.monotonic() - start
        assert handle.done() and waited >= 0.9, waited
    later.wait(timeout=60)
    assert_loads_everywhere(tmp_path / "a", tx, params, first, step=1)
    assert_loads_everywhere(tmp_path / "b", tx, params, second, step=2)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["exit-ok", "exit-fail"])
def test_exiting_with_a_save_in_flight(tmp_path: Path, mode: str) -> None:
    tx, params = problem()
    first = bumped(tx.init(params), 2)
    path = tmp_path / "ckpt"
    save_optimizer_state(path, tx, first, params, step=1)
    proc = _run_worker(path, mode)
    out, err = proc.communicate(timeout=TIMEOUT_S)
    assert out == "returned\n", err
    if mode == "exit-ok":
        assert proc.returncode == 0, err
        assert_loads_everywhere(path, tx, params, bumped(first, 1), step=2)
        return
    assert proc.returncode == SAVE_FAILED_EXIT, err
    assert (
        "gradsync: a background save failed and the program ended without waiting for it: "
        f"cannot save optimizer checkpoint {path}: process 0 could not write its file: "
        "OSError: [Errno 28] No space left on device"
    ) in err, err
    assert_loads_everywhere(path, tx, params, first, step=1)
