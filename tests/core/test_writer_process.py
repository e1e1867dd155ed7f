"""The writer process of saves with ``blocking=False`` (``write_staged_rank_file``),
framework-free: it writes the file a writer thread writes, from shared staging memory; a
failure keeps its sentence; its death is a failure and the next write starts a new one; a
forked child does not inherit it (docs/design-checkpoints.md §9).
"""

from __future__ import annotations

import array
import errno
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync_core.checkpoint import (
    WRITER_NICE,
    SharedStaging,
    StagedTensor,
    TensorBytes,
    sha256_file,
    tensor_file,
    write_rank_file,
    write_staged_rank_file,
)
from gradsync_core.checkpoint._writer_process import WRITER

VALUES = array.array("f", [float(i) / 7 for i in range(1000)]).tobytes()
COUNTS = array.array("q", [3, 1, 4, 1, 5]).tobytes()
METADATA = {"rank": "0", "world_size": "1"}
ROOT = Path(__file__).resolve().parents[2]


def _staged() -> tuple[SharedStaging, list[StagedTensor]]:
    """Two tensors, the second 8-byte aligned, in shared staging memory."""
    memory = SharedStaging()
    second = -(-len(VALUES) // 8) * 8
    mapping = memory.reserve(second + len(COUNTS))
    mapping[: len(VALUES)] = VALUES
    mapping[second : second + len(COUNTS)] = COUNTS
    return memory, [
        StagedTensor("w/exp_avg", "F32", (10, 100), 0),
        StagedTensor("w/step", "I64", (5,), second),
    ]


def test_the_writer_process_writes_the_file_the_training_process_would(tmp_path: Path) -> None:
    memory, tensors = _staged()
    digest = write_staged_rank_file(memory, str(tmp_path), "staged.safetensors", tensors, METADATA)
    chunks = tensor_file(
        [
            TensorBytes("w/exp_avg", "F32", (10, 100), VALUES),
            TensorBytes("w/step", "I64", (5,), COUNTS),
        ],
        METADATA,
    )
    here = write_rank_file(str(tmp_path), "here.safetensors", chunks)
    assert WRITER.pid is not None and WRITER.pid != os.getpid()
    staged, written = tmp_path / "staged.safetensors", tmp_path / "here.safetensors"
    assert digest == here == sha256_file(staged)
    assert staged.read_bytes() == written.read_bytes()
    assert staged.stat().st_mode == written.stat().st_mode  # the same umask
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here.safetensors", "staged.safetensors"]


def test_a_failed_write_keeps_its_sentence(tmp_path: Path) -> None:
    memory, tensors = _staged()
    missing = tmp_path / "missing"
    with pytest.raises(FileNotFoundError) as raised:
        write_staged_rank_file(memory, str(missing), "r.safetensors", tensors, METADATA)
    assert raised.value.errno == errno.ENOENT
    assert str(raised.value).startswith("[Errno 2] No such file or directory: ")
    assert str(missing) in str(raised.value)
    with pytest.raises(ValueError, match="bytes, expected 8000"):  # tensor_file's words
        wrong = [StagedTensor("w/exp_avg", "F64", (10, 100), 0)]
        write_staged_rank_file(memory, str(tmp_path), "r.safetensors", wrong, METADATA)


def test_a_dead_writer_is_a_failure_and_the_next_write_starts_a_new_one(tmp_path: Path) -> None:
    memory, tensors = _staged()
    write_staged_rank_file(memory, str(tmp_path), "first.safetensors", tensors, METADATA)
    dead = WRITER.pid
    assert dead is not None
    os.kill(dead, signal.SIGKILL)
    with pytest.raises(RuntimeError) as raised:
        write_staged_rank_file(memory, str(tmp_path), "second.safetensors", tensors, METADATA)
    assert str(raised.value) == (
        f"the save's writer process (pid {dead}) ended (killed by SIGKILL) before it finished "
        "second.safetensors; the next save starts a new one"
    )
    assert WRITER.pid is None  # reaped: no zombie left
    write_staged_rank_file(memory, str(tmp_path), "third.safetensors", tensors, METADATA)
    assert WRITER.pid not in (None, dead)
    assert (tmp_path / "third.safetensors").read_bytes() == (
        tmp_path / "first.safetensors"
    ).read_bytes()


# Run in a fresh interpreter: the test process may hold JAX's or torch's threads, which a
# fork would copy mid-flight.
_FORK = """
import os, sys
from gradsync_core.checkpoint import SharedStaging, StagedTensor, write_staged_rank_file
from gradsync_core.checkpoint._writer_process import WRITER

root, memory = sys.argv[1], SharedStaging()
memory.reserve(8)[:8] = bytes(range(8))
tensors, meta = [StagedTensor("w", "U8", (8,), 0)], {"rank": "0"}
write_staged_rank_file(memory, root, "parent.safetensors", tensors, meta)
parent = WRITER.pid
child = os.fork()
if child == 0:  # a data loader's worker, say: it must not talk over the parent's socket
    status = 1 if WRITER.pid is not None else 0
    try:
        write_staged_rank_file(memory, root, "child.safetensors", tensors, meta)
        status = status or (2 if WRITER.pid in (None, parent) else 0)
        WRITER.stop()
    except BaseException:
        status = 3
    os._exit(status)
_, status = os.waitpid(child, 0)
assert os.waitstatus_to_exitcode(status) == 0, os.waitstatus_to_exitcode(status)
assert WRITER.pid == parent, "the parent's writer was replaced"
write_staged_rank_file(memory, root, "after.safetensors", tensors, meta)
"""


def test_a_forked_child_does_not_share_the_writer(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _FORK, str(tmp_path)],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    written = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(written) == ["after.safetensors", "child.safetensors", "parent.safetensors"]
    assert len(set(written.values())) == 1


def test_the_writer_runs_at_the_writer_priority_and_ignores_the_jobs_signals(
    tmp_path: Path,
) -> None:
    memory, tensors = _staged()
    write_staged_rank_file(memory, str(tmp_path), "a.safetensors", tensors, METADATA)
    pid = WRITER.pid
    assert pid is not None
    assert os.getpriority(os.PRIO_PROCESS, pid) == WRITER_NICE
    for sent in (signal.SIGINT, signal.SIGTERM):  # a scheduler's or a terminal's, to the job
        os.kill(pid, sent)
    time.sleep(0.2)
    write_staged_rank_file(memory, str(tmp_path), "b.safetensors", tensors, METADATA)
    assert WRITER.pid == pid
