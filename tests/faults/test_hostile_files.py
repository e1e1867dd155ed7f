"""Hostile checkpoint files are refused before anything reads them, with one sentence
(issue 21, item 3; docs/design.md §15): a rank file or manifest that is a link to /dev/zero, a
FIFO, a directory, a link loop or a link to a file outside the checkpoint, and a manifest over
the size cap. ``gradsync checkpoint inspect`` prints one line and exits 2 for each, and loaders
raise ``ValueError`` instead of hanging or reading outside the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gradsync_core import read_manifest
from gradsync_core.checkpoint import MANIFEST, MAX_MANIFEST_BYTES, rank_file
from tests.support.checkpoints import write_checkpoint

RANK1 = rank_file(1, 2)


def _replace(target: str, make: Callable[[Path, Path], None]) -> Callable[[Path], None]:
    def damage(directory: Path) -> None:
        path = directory / target
        path.unlink()
        make(path, directory)

    return damage


def _link_outside(path: Path, directory: Path) -> None:
    outside = directory.parent / "secret.txt"
    outside.write_text("not yours")
    path.symlink_to(outside)


def _huge_manifest(path: Path, directory: Path) -> None:
    with open(path, "wb") as f:
        f.truncate(MAX_MANIFEST_BYTES + 1)  # sparse: costs no disk


CASES = {
    "rank file -> /dev/zero": (
        _replace(RANK1, lambda p, d: p.symlink_to("/dev/zero")),
        "link to /dev/zero, outside",
    ),
    "rank file is a FIFO": (
        _replace(RANK1, lambda p, d: os.mkfifo(p)),
        "is a FIFO, not a regular file",
    ),
    "rank file is a directory": (
        _replace(RANK1, lambda p, d: p.mkdir()),
        "is a directory, not a regular file",
    ),
    "rank file links out": (_replace(RANK1, _link_outside), "outside the checkpoint"),
    "manifest -> /dev/zero": (
        _replace(MANIFEST, lambda p, d: p.symlink_to("/dev/zero")),
        "link to /dev/zero, outside",
    ),
    "manifest is a directory": (
        _replace(MANIFEST, lambda p, d: p.mkdir()),
        "is a directory, not a regular file",
    ),
    "manifest link loop": (
        _replace(MANIFEST, lambda p, d: p.symlink_to(p.name)),
        "cannot be opened",
    ),
    "manifest over the cap": (_replace(MANIFEST, _huge_manifest), "is larger than 256 MiB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hostile_files_are_refused_in_one_line(tmp_path: Path, case: str) -> None:
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint(directory)
    damage, message = CASES[case]
    damage(directory)
    with pytest.raises(ValueError, match=message):
        read_manifest(directory)  # hashes every file
    out = subprocess.run(
        [sys.executable, "-m", "gradsync_core", "checkpoint", "inspect", str(directory)],
        capture_output=True,
        text=True,
        timeout=60,  # a FIFO or /dev/zero would hang here without the checks
    )
    assert out.returncode == 2, out.stderr
    assert out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert message.split(",")[0] in out.stderr
