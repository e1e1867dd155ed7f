"""Faults while a torch save with ``blocking=False`` writes in the background (docs/design.md
§9 and §15): a killed rank, a full disk, a raising writer, a second save, an interpreter that
exits with the save in flight, and 1,000 saves in a row.

In every case the previous checkpoint still loads bitwise at another world size (a plain
torch Adam, world size 1) and in the other framework (``optax.adam`` in JAX;
tests/faults/async_save_loads.py), and the failure reaches every rank as one sentence
(tests/faults/async_save_faults.py).
"""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from gradsync_core.checkpoint import SAVE_FAILED_EXIT
from tests.faults import async_save_faults as faults
from tests.faults.async_save_loads import assert_loads_everywhere
from tests.support.harness import run_workers, run_workers_outcomes

PG_TIMEOUT_S = 5.0
WORLD = 2
ROOT = Path(__file__).resolve().parents[2]


def _kill(directory: Path, point: str) -> tuple[str, str, list[Any]]:
    path = str(directory / point.replace(" ", "-"))
    outcomes = run_workers_outcomes(
        faults.crash_in_background, WORLD, path, point, timeout=60, pg_timeout_s=PG_TIMEOUT_S
    )
    return point, path, outcomes


@pytest.mark.slow
def test_a_rank_killed_during_the_background_write_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda p: _kill(tmp_path, p), faults.KILL_POINTS))
    for point, path, outcomes in runs:
        dying = faults.KILL_POINTS[point][0]
        assert outcomes[dying].exitcode == faults.DIED, f"{point}: {outcomes[dying]}"
        survivor = outcomes[1 - dying]
        assert survivor.error is None and survivor.exitcode == 0, f"{point}: {survivor}"
        raised = survivor.value["raised"]
        # One sentence, at wait(), once the broken collective says the peer is gone.
        assert raised is not None and raised.startswith(
            f"cannot save optimizer checkpoint {path} (rank {1 - dying}): "
        ), f"{point}: {raised}"
        assert survivor.value["seconds"] < PG_TIMEOUT_S + 5, f"{point}: {survivor.value}"
        assert os.path.islink(path)
        assert_loads_everywhere(path, survivor.value["saved"], point)


def test_failures_in_the_background_reach_every_rank_and_keep_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    results = run_workers(faults.failures_in_background, WORLD, str(tmp_path), timeout=240)
    messages = [r["messages"] for r in results]
    assert messages[0] == messages[1]  # the same sentence on every rank
    full = tmp_path / "disk-full"
    assert messages[0] == {
        "disk full, at wait()": (
            f"cannot save optimizer checkpoint {full} (rank 1): rank 1 could not write its "
            "file: OSError: [Errno 28] No space left on device"
        ),
        "disk full, at the next save": (
            f"cannot save optimizer checkpoint {full}-unwaited (rank 1): rank 1 could not "
            "write its file: OSError: [Errno 28] No space left on device"
        ),
        "the writer raises": (
            f"cannot save optimizer checkpoint {tmp_path / 'writer-raises'} (rank 0): rank 0 "
            "could not write its file: RuntimeError: the writer broke"
        ),
    }
    saved = results[0]
    assert_loads_everywhere(full, saved["saved"], "disk full")
    assert_loads_everywhere(tmp_path / "disk-full-unwaited", saved["unwaited"], "unwaited")
    # The second save waited for the first (held 1 s) and each holds its own state.
    assert saved["second waited"] >= 0.9, saved["second waited"]
    assert_loads_everywhere(tmp_path / "first", saved["first"], "first of two")
    assert_loads_everywhere(tmp_path / "second", saved["second"], "second of two")


def test_a_write_the_kernel_refuses_reaches_every_rank_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    results = run_workers(faults.file_too_large, WORLD, str(tmp_path), timeout=240)
    path = tmp_path / "too-large"
    assert (
        results[0]["raised"]
        == results[1]["raised"]
        == (
            f"cannot save optimizer checkpoint {path} (rank 1): rank 1 could not write its file: "
            "OSError: [Errno 27] File too large"
        )
    )
    assert results[0]["leftovers"] == [], results[0]["leftovers"]  # no staging, no temp file
    assert_loads_everywhere(path, results[0]["saved"], "file too large", *faults.BIG_SIZES)


def test_a_killed_writer_process_reaches_every_rank_and_the_next_save_starts_a_new_one(
    tmp_path: Path,
) -> None:
    results = run_workers(faults.writer_killed, WORLD, str(tmp_path), timeout=240)
    path = tmp_path / "writer-killed"
    (killed,), _ = results[1]["writers"]
    assert (
        results[0]["raised"]
        == results[1]["raised"]
        == (
            f"cannot save optimizer checkpoint {path} (rank 1): rank 1 could not write its file: "
            f"RuntimeError: the save's writer process (pid {killed}) ended (killed by SIGKILL) "
            "before it finished rank-00001-of-00002.safetensors; the next save starts a new one"
        )
    )
    for rank, result in enumerate(results):
        (before,), (now,) = result["writers"]  # one writer per rank, the killed one replaced
        assert (now != before) == (rank == 1), (rank, result["writers"])
    assert not any(".tmp-" in n for n in os.listdir(tmp_path))  # its staging directory: gone
    assert_loads_everywhere(path, results[0]["saved"], "writer killed")
    assert_loads_everywhere(tmp_path / "after", results[0]["after"], "the save after")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ok", "fail"])
def test_exiting_with_a_save_in_flight(tmp_path: Path, mode: str) -> None:
    path = tmp_path / "ckpt"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    worker = ROOT / "tests" / "faults" / "async_exit_worker.py"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(worker),
                str(r),
                str(WORLD),
                str(tmp_path / "store"),
                str(path),
                mode,
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in range(WORLD)
    ]
    try:
        outputs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for rank, (p, (out, err)) in enumerate(zip(procs, outputs, strict=True)):
        assert out == f"rank {rank}: returned\n", err
        if mode == "ok":
            assert p.returncode == 0, err
            continue
        # Not "exit 0 having written no checkpoint": the status says so, stderr says why.
        assert p.returncode == SAVE_FAILED_EXIT, err
        assert (
            "gradsync: a background save failed and the program ended without waiting for it: "
            f"cannot save optimizer checkpoint {path} (rank 1): rank 1 could not write its "
            "file: OSError: [Errno 28] No space left on device"
        ) in err, err
    if mode == "ok":
        assert_loads_everywhere(path, dict(np.load(f"{path}.npz")), "saved at exit")
    else:
        assert not os.path.lexists(path)


@pytest.mark.slow
def test_a_thousand_saves_leak_no_buffer_thread_or_descriptor(tmp_path: Path) -> None:
    saves = 1000
    results = run_workers(faults.soak, WORLD, str(tmp_path), saves, timeout=1200)
    for rank, seen in enumerate(results):
        early, middle, late = seen[saves // 10], seen[saves // 2], seen[saves]
        assert early["threads"] == middle["threads"] == late["threads"] == 1, (rank, seen)
        # gloo and the file store open and close a descriptor or start a native thread of
        # their own now and then (measured: +-1); one per save would be +900 here.
        for what in ("fds", "os threads"):
            assert max(middle[what], late[what]) <= early[what] + 1, (rank, what, seen)
        # A staging buffer kept per save would add ~1 MiB a save: 900 MiB here.
        assert late["rss"] - early["rss"] < 16 << 20, (rank, seen)
