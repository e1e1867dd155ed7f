"""The switching-save protocol of gradsync_core (docs/design.md §9), on plain files.

Each test stages a "checkpoint" (a manifest and a rank file with recognizable contents),
commits it or fails part-way, and checks what a reader of ``PATH`` sees: always one whole
checkpoint, the previous one until the new one is committed.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gradsync_core.checkpoint import (
    MANIFEST,
    _atomic,
    begin_save,
    commit_save,
    discard_save,
    new_save_token,
    rank_file,
    write_atomic,
)

RANK0 = rank_file(0, 1)


def _stage(path: Path, text: str) -> str:
    staging = begin_save(path, new_save_token())
    Path(staging, RANK0).write_text(text)
    Path(staging, MANIFEST).write_text(f"manifest of {text}")
    return staging


def _save(path: Path, text: str) -> None:
    commit_save(path, _stage(path, text))


def _read(path: Path) -> tuple[str, str]:
    return (path / RANK0).read_text(), (path / MANIFEST).read_text()


def _siblings(path: Path) -> list[str]:
    # The switch lock's file (hidden, empty, always there once a save ran) is not a version.
    lock = os.path.basename(_atomic.lock_file(path))
    return sorted(
        p.name.replace(path.name, "PATH")[:7] for p in path.parent.iterdir() if p.name != lock
    )


def test_saves_switch_a_link_and_remove_superseded_versions(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "one")
    assert path.is_symlink() and _read(path) == ("one", "manifest of one")
    first = os.readlink(path)
    _save(path, "two")
    assert _read(path) == ("two", "manifest of two")
    assert os.readlink(path) != first and not (tmp_path / first).exists()
    assert _siblings(path) == ["PATH", "PATH.v-"]  # the link and the one version it names


def test_a_save_cut_short_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    _save(path, "one")
    staging = _stage(path, "two")  # a crash here: files written, never committed
    assert _read(path) == ("one", "manifest of one")
    assert os.path.isdir(staging)
    # A crash drops the save lock (the kernel does, for a dead process; run_save does, for a
    # save that ended early in a live one): the directory is abandoned from then on.
    _atomic.release_save(staging)
    # The next save removes the stale staging directory before writing, and never reads it.
    _save(path, "three")
    assert not os.path.exists(staging)
    assert _read(path) == ("three", "manifest of three")
    discard_save(_stage(path, "four"))  # a failure the writer saw: it removes its own
    assert _read(path) == ("three", "manifest of three")
    assert _siblings(path) == ["PATH", "PATH.v-"]


@pytest.mark.parametrize("step", ["fsync_directory", "_switch"])
def test_a_failing_commit_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    path = tmp_path / "ckpt"
    _save(path, "one")
    staging = _stage(path, "two")

    def fail(*args: object) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_atomic, step, fail)
    with pytest.raises(OSError, match="Input/output error"):
        commit_save(path, staging)
    monkeypatch.undo()
    discard_save(staging)
    assert _read(path) == ("one", "manifest of one")
    assert _siblings(path) == ["PATH", "PATH.v-"]  # what the failed commit made is gone


def test_a_directory_from_before_switching_saves_is_adopted(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / RANK0).write_text("old")
    (path / MANIFEST).write_text("manifest of old")
    (path / ".tmp-abcrank-00000-of-00001.safetensors").write_text("half")  # write_atomic's
    staging = _stage(path, "new")
    assert _read(path) == ("old", "manifest of old")  # untouched until the switch
    commit_save(path, staging)
    assert path.is_symlink() and _read(path) == ("new", "manifest of new")
    assert _siblings(path) == ["PATH", "PATH.v-"]
    empty = tmp_path / "empty"
    empty.mkdir()
    _save(empty, "first")
    assert _read(empty) == ("first", "manifest of first")


def test_a_failed_switch_puts_an_adopted_directory_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "ckpt"
    path.mkdir()
    (path / RANK0).write_text("old")
    (path / MANIFEST).write_text("manifest of old")
    staging = _stage(path, "new")
    real_replace = os.replace

    def refuse_link(src: str, dst: str) -> None:
        if os.fspath(dst) == os.fspath(path):
            raise OSError(1, "Operation not permitted")
        real_replace(src, dst)

    monkeypatch.setattr(_atomic.os, "replace", refuse_link)
    with pytest.raises(OSError, match="Operation not permitted"):
        commit_save(path, staging)
    monkeypatch.undo()
    assert not path.is_symlink() and _read(path) == ("old", "manifest of old")
    assert _siblings(path) == ["PATH"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (
            lambda p: (p.mkdir(), (p / "notes.txt").write_text("mine")),
            r"the directory holds 1 file\(s\) that are not part of a checkpoint "
            r"\(e\.g\. 'notes\.txt'\); save to a path of its own",
        ),
        (lambda p: p.write_text("a file"), r"it is a file, not a directory"),
        (
            lambda p: p.symlink_to(p.parent),
            r"it is a link to .* which gradsync did not create; pass the directory it points "
            r"to, or remove the link",
        ),
    ],
    ids=["foreign files", "a file", "a foreign link"],
)
def test_a_path_that_holds_user_data_is_refused_before_writing(
    tmp_path: Path, make: object, message: str
) -> None:
    path = tmp_path / "ckpt"
    make(path)  # type: ignore[operator]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"cannot save a checkpoint at .*ckpt: " + message):
        begin_save(path, new_save_token())
    assert sorted(p.name for p in tmp_path.iterdir()) == before


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o027, 0o640)])
def test_checkpoint_files_get_the_process_umask(tmp_path: Path, umask: int, mode: int) -> None:
    # Issue 21: rank files were 0600 (mkstemp's mode), unreadable to the group a job shares.
    previous = os.umask(umask)
    try:
        staging = begin_save(tmp_path / "ckpt", new_save_token())
        write_atomic(os.path.join(staging, RANK0), b"weights")
    finally:
        os.umask(previous)
    assert stat.S_IMODE(os.stat(os.path.join(staging, RANK0)).st_mode) == mode
    discard_save(staging)
