"""Two jobs saving to one path never destroy each other's checkpoint (issue 21, item 1;
docs/design.md §9, "Concurrent saves").

A save removes only versions it can prove are abandoned (no live save holds their lock) or
superseded (under the switch lock, any complete version ``PATH`` does not name); a crashed
save blocks nobody; and a reader racing two writers never gets a mixed load.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync_core.checkpoint import (
    MANIFEST,
    _atomic,
    begin_save,
    commit_save,
    discard_save,
    new_save_token,
)

ROOT = Path(__file__).resolve().parents[2]

# Another job, as a separate process: a whole save of ``text``, or one that dies mid-save.
_OTHER_JOB = """
import os, sys
from gradsync_core.checkpoint import begin_save, commit_save, new_save_token
path, text, die = sys.argv[1], sys.argv[2], sys.argv[3] == "die"
staging = begin_save(path, new_save_token())
with open(os.path.join(staging, "manifest.json"), "w") as f:
    f.write(text)
if die:
    os._exit(17)  # no clean-up: its staging directory stays, its save lock dies with it
commit_save(path, staging)
"""


def _other_job(path: Path, text: str, *, die: bool = False) -> float:
    """Run the other job to its end; its duration in seconds."""
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", _OTHER_JOB, str(path), text, "die" if die else "save"],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=60,
        check=False,
    )
    assert done.returncode == (17 if die else 0)
    return time.monotonic() - start


def _save(path: Path, text: str) -> None:
    staging = begin_save(path, new_save_token())
    Path(staging, MANIFEST).write_text(text)
    commit_save(path, staging)


def _manifest(path: Path) -> str:
    return (path / MANIFEST).read_text()


def _beside(path: Path) -> list[str]:
    """What lies beside ``path``: ``v-`` / ``tmp-`` per version directory, ``PATH`` itself."""
    return sorted(
        "PATH" if p.name == path.name else p.name[len(path.name) + 1 :].partition("-")[0] + "-"
        for p in path.parent.iterdir()
        if p.name != os.path.basename(_atomic.lock_file(path))  # the switch lock's file
    )


def test_a_save_in_progress_is_never_removed_by_another_job(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "first")
    ours = begin_save(path, new_save_token())  # this job's save, between begin and commit
    # The other job saves whole meanwhile, without waiting for ours (the switch lock is not
    # held across a save), and leaves our staging directory alone: it is locked, so live.
    assert _other_job(path, "theirs") < 30
    assert _manifest(path) == "theirs" and os.path.isdir(ours)
    Path(ours, MANIFEST).write_text("ours")
    commit_save(path, ours)  # the later switch wins, whole; what it superseded is removed
    assert _manifest(path) == "ours"
    assert _beside(path) == ["PATH", "v-"]


def test_a_crashed_save_blocks_nothing_and_is_removed(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "first")
    _other_job(path, "crashed", die=True)
    assert _beside(path) == ["PATH", "tmp-", "v-"]  # its staging directory stayed
    _save(path, "after the crash")  # its lock died with it: abandoned, removed
    assert _manifest(path) == "after the crash"
    assert _beside(path) == ["PATH", "v-"]


def test_this_process_releases_a_save_cut_short(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "first")
    cut = begin_save(path, new_save_token())
    _save(path, "second")  # ``cut`` is still held: a save in progress, kept
    assert os.path.isdir(cut)
    _atomic.release_save(cut)  # what run_save does once a save is over, however it ended
    _save(path, "third")
    assert not os.path.exists(cut) and _beside(path) == ["PATH", "v-"]
    failed = begin_save(path, new_save_token())
    discard_save(failed)  # removed and released
    assert _beside(path) == ["PATH", "v-"] and _manifest(path) == "third"


# A writer job for the race below: ``SAVES`` saves of a two-file "checkpoint" whose files hold
# the same text, checking after each that PATH names a complete one.
_WRITER = """
import os, sys
from gradsync_core.checkpoint import MANIFEST, begin_save, commit_save, new_save_token, write_atomic
path, writer, saves = sys.argv[1], sys.argv[2], int(sys.argv[3])
for i in range(saves):
    text = f"{writer}:{i}".encode()
    staging = begin_save(path, new_save_token())
    write_atomic(os.path.join(staging, "rank-00000-of-00001.safetensors"), text)
    write_atomic(os.path.join(staging, MANIFEST), text)
    commit_save(path, staging)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        sys.exit(f"lost: {path} -> {os.readlink(path)} after save {i}")
"""


def test_two_writers_and_a_reader_never_mix_or_lose_a_checkpoint(tmp_path: Path) -> None:
    # The protocol's short stress run, on plain files (the full one, with JAX saves and loads:
    # ``python -m tests.faults.stress_concurrent_saves --saves 300``, docs/design.md §9).
    path, saves = tmp_path / "ckpt", 40
    _save(path, "start:0")
    writers = [
        subprocess.Popen(
            [sys.executable, "-c", _WRITER, str(path), f"w{w}", str(saves)],
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        for w in range(2)
    ]
    counts = {"ok": 0, "retried": 0, "mixed": 0, "lost": 0}
    while any(w.poll() is None for w in writers) or counts["ok"] == 0:
        version = _atomic.resolve_checkpoint(path)  # a reader resolves once, then reads
        try:
            manifest = Path(version, MANIFEST).read_text()
            rank = Path(version, "rank-00000-of-00001.safetensors").read_text()
        except FileNotFoundError:  # a save removed the version meanwhile: load again
            counts["lost" if not (path / MANIFEST).is_file() else "retried"] += 1
            continue
        counts["ok" if manifest == rank else "mixed"] += 1
    assert [w.wait(timeout=60) for w in writers] == [0, 0]
    assert counts["mixed"] == 0 and counts["lost"] == 0, counts
    assert _manifest(path) in (f"w0:{saves - 1}", f"w1:{saves - 1}")  # a last save, whole
    assert _beside(path) == ["PATH", "v-"]


def test_saves_work_where_directories_cannot_be_locked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # NFS refuses an exclusive flock on a directory (EBADF): a save there still works, as it
    # did before the locks (one job per path), and still removes what a crash left.
    def no_locks(fd: int, flags: int) -> None:
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    monkeypatch.setattr(_atomic.fcntl, "flock", no_locks)
    path = tmp_path / "ckpt"
    _save(path, "first")
    crashed = begin_save(path, new_save_token())
    _atomic.release_save(crashed)
    _save(path, "second")
    assert _manifest(path) == "second" and _beside(path) == ["PATH", "v-"]
