"""Two jobs saving to one path never destroy each other's checkpoint (issue 21, item 1;
docs/design.md §9): saves to a path are serialized by a lock file beside it, so a save only removes
versions that are provably abandoned or superseded, and ``PATH`` always names a complete
checkpoint."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

from gradsync_core._atomic import lock_file
from gradsync_core.checkpoint import begin_save, commit_save, discard_save, new_save_token

SAVES = 40
WRITERS = 2


def _save(path: str, payload: str) -> None:
    """One complete save: a marker file staged, then the switch."""
    staging = begin_save(path, new_save_token())
    try:
        with open(os.path.join(staging, "manifest.json"), "w") as f:
            f.write(payload)
    except BaseException:
        discard_save(staging)
        raise
    commit_save(path, staging)


def _writer(path: str, writer: int, failures: mp.Queue) -> None:
    for i in range(SAVES):
        _save(path, f"{writer}:{i}")
        # Right after its own save, the checkpoint PATH names must be complete (ours, or a
        # later one of the other writer), never a deleted directory.
        if not os.path.isfile(os.path.join(path, "manifest.json")):
            failures.put(f"writer {writer} save {i}: {path} -> {os.readlink(path)} is gone")


def test_two_jobs_saving_to_one_path_lose_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(path, w, failures)) for w in range(WRITERS)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert errors == []
    # The last successful save is what PATH names, and nothing else is left beside it.
    with open(os.path.join(path, "manifest.json")) as f:
        assert f.read().endswith(f":{SAVES - 1}")
    lock = os.path.basename(lock_file(path))
    left = sorted(n for n in os.listdir(tmp_path) if n not in ("ckpt", lock))
    assert left == [os.readlink(path)]


def test_a_save_waits_for_the_one_in_progress(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _save(path, "first")
    staging = begin_save(path, new_save_token())  # a save in progress (this "job")
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=_save, args=(path, "second"))  # another job
    other.start()
    # The other job's cleanup would remove our staging directory: it must wait for us.
    other.join(timeout=3)
    assert other.is_alive() and os.path.isdir(staging)
    with open(os.path.join(staging, "manifest.json"), "w") as f:
        f.write("ours")
    commit_save(path, staging)
    other.join(timeout=60)
    assert other.exitcode == 0
    with open(os.path.join(path, "manifest.json")) as f:
        assert f.read() == "second"  # the later save wins, whole


def test_a_crashed_holder_does_not_block_the_next_save(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    _save(path, "first")
    ctx = mp.get_context("spawn")
    crashed = ctx.Process(target=_begin_and_die, args=(path,))
    crashed.start()
    crashed.join(timeout=60)
    assert crashed.exitcode == 17
    _save(path, "after the crash")  # the kernel dropped the dead holder's lock
    with open(os.path.join(path, "manifest.json")) as f:
        assert f.read() == "after the crash"
    lock = os.path.basename(lock_file(path))
    assert sorted(os.listdir(tmp_path)) == sorted(["ckpt", lock, os.readlink(path)])


def _begin_and_die(path: str) -> None:
    begin_save(path, new_save_token())
    os._exit(17)
