"""The writer process of saves with ``blocking=False`` (``write_staged_rank_file``),
framework-free: it writes the file a writer thread writes, from shared staging memory; a
failure keeps its sentence; its death is a failure and the next write starts a new one; a
forked child does not inherit it; paced, it spends at most its share of a core, and a wait
for the save lifts the pace (docs/design-checkpoints.md §9).
"""

from __future__ import annotations

import array
import ctypes
import errno
import hashlib
import math
import mmap
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gradsync_core.checkpoint import (
    WRITER_NICE,
    WRITER_SHARE,
    SharedStaging,
    StagedTensor,
    TensorBytes,
    _storage,
    set_writer_share,
    sha256_file,
    tensor_file,
    write_atomic,
    write_rank_file,
    write_staged_rank_file,
    writer_share,
)
from gradsync_core.checkpoint._background import start_background, wait_for_saves
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


def _cached_pages(path: Path) -> tuple[int, int]:
    """How many of ``path``'s pages the kernel's page cache holds, of how many (``mincore``)."""
    size = path.stat().st_size
    pages = -(-size // mmap.PAGESIZE)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mapped:
        where = ctypes.c_char.from_buffer(mapped)  # no page is touched: nothing is read in
        try:
            vec = (ctypes.c_ubyte * pages)()
            libc = ctypes.CDLL(None, use_errno=True)
            address = ctypes.c_void_p(ctypes.addressof(where))
            assert libc.mincore(address, ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        finally:
            del where
    return sum(v & 1 for v in vec), pages


def _direct_io(directory: Path) -> bool:
    """Whether ``directory``'s file system takes ``O_DIRECT`` (tmpfs before Linux 6.6 does not)."""
    try:
        fd = os.open(directory / ".probe", os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError:
        return False
    os.close(fd)
    os.unlink(directory / ".probe")
    return True


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_the_writer_process_writes_around_the_page_cache(tmp_path: Path) -> None:
    # A busy training's cores pay for a cached write thrice: the copy into the cache, the
    # kernel's writeback and, when the save removes the version, freeing its pages.
    if not _direct_io(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    memory = SharedStaging()
    values = os.urandom(3 * (8 << 20) + 12345)  # three full slices and a tail of no block
    memory.reserve(len(values))[: len(values)] = values
    tensors = [StagedTensor("w", "U8", (len(values),), 0)]
    digest = write_staged_rank_file(memory, str(tmp_path), "staged.safetensors", tensors, METADATA)
    cached, pages = _cached_pages(tmp_path / "staged.safetensors")
    assert cached <= 1 and pages > 6000  # at most the tail's page, written through the cache
    here = write_rank_file(
        str(tmp_path),
        "here.safetensors",
        tensor_file([TensorBytes("w", "U8", (len(values),), values)], METADATA),
    )
    assert _cached_pages(tmp_path / "here.safetensors")[0] == pages  # a cached write's
    assert digest == here == sha256_file(tmp_path / "staged.safetensors")
    assert (tmp_path / "staged.safetensors").read_bytes() == (
        tmp_path / "here.safetensors"
    ).read_bytes()


@pytest.mark.parametrize(
    "sizes", [[], [1], [4096], [8 << 20], [(8 << 20) + 5, 4096, 3], [100, 9 << 20]]
)
def test_a_direct_write_is_the_cached_write(tmp_path: Path, sizes: list[int]) -> None:
    # The same bytes, digest, mode and leftovers (none) with and without O_DIRECT, whatever
    # the sizes against the aligned buffer's.
    chunks = [b"header", *(os.urandom(n) for n in sizes)]
    cached, direct = hashlib.sha256(), hashlib.sha256()
    write_atomic(tmp_path / "cached", chunks, digest=cached)
    write_atomic(tmp_path / "direct", chunks, digest=direct, direct=True)
    written = (tmp_path / "direct").read_bytes()
    assert written == (tmp_path / "cached").read_bytes() == b"".join(chunks)
    assert direct.hexdigest() == cached.hexdigest() == hashlib.sha256(written).hexdigest()
    assert (tmp_path / "direct").stat().st_mode == (tmp_path / "cached").stat().st_mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cached", "direct"]


@pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's")
def test_a_direct_write_the_kernel_refuses_goes_on_through_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Blocks of 8 bytes: a full buffer goes directly, then the kernel refuses the direct
    # write of the last 24 bytes (EINVAL: not a multiple of the disk's block), as a file
    # system with blocks over 4 KiB would refuse a write of 4 KiB; the rest goes cached.
    if not _direct_io(tmp_path):
        pytest.skip(f"{tmp_path}'s file system refuses O_DIRECT")
    monkeypatch.setattr(_storage, "_DIRECT_ALIGN", 8)
    chunks = [os.urandom((8 << 20) + 13), os.urandom(13)]  # a full buffer, then 26 bytes
    digest = hashlib.sha256()
    write_atomic(tmp_path / "direct", chunks, digest=digest, direct=True)
    assert (tmp_path / "direct").read_bytes() == b"".join(chunks)
    assert digest.hexdigest() == hashlib.sha256(b"".join(chunks)).hexdigest()
    assert [p.name for p in tmp_path.iterdir()] == ["direct"]


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
from gradsync_core.checkpoint import _storage
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


@pytest.fixture
def share() -> object:
    """Restores the writer's default share after the test."""
    yield set_writer_share
    set_writer_share(WRITER_SHARE)


def _large(nbytes: int) -> tuple[SharedStaging, list[StagedTensor]]:
    """One tensor of ``nbytes`` (a multiple of 1 MiB) in shared staging memory."""
    memory = SharedStaging()
    memory.reserve(nbytes)[:] = os.urandom(2**20) * (nbytes // 2**20)
    return memory, [StagedTensor("w", "U8", (nbytes,), 0)]


def _cpu_s(pid: int) -> float:
    """A process's CPU time so far, user and system (``/proc/<pid>/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="/proc is Linux's")
def test_a_paced_writer_spends_at_most_its_share_of_a_core(tmp_path: Path, share) -> None:
    memory, tensors = _large(48 * 2**20)
    share(1.0)
    unpaced = write_staged_rank_file(memory, str(tmp_path), "a.safetensors", tensors, METADATA)
    share(0.2)
    assert writer_share() == 0.2
    pid = WRITER.pid
    assert pid is not None
    cpu, start = _cpu_s(pid), time.monotonic()
    paced = write_staged_rank_file(memory, str(tmp_path), "b.safetensors", tensors, METADATA)
    wall, cpu = time.monotonic() - start, _cpu_s(pid) - cpu
    assert paced == unpaced == sha256_file(tmp_path / "b.safetensors")
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    assert cpu <= 0.2 * wall + 2 / os.sysconf("SC_CLK_TCK"), (cpu, wall)  # 2 ticks' rounding


def test_a_wait_for_the_save_lifts_the_writers_pace(tmp_path: Path, share) -> None:
    memory, tensors = _large(48 * 2**20)
    share(1.0)
    unpaced = write_staged_rank_file(memory, str(tmp_path), "a.safetensors", tensors, METADATA)
    # At 1 % of a core, hashing 48 MiB alone (>= 24 ms at 2 GB/s) would take >= 2.4 s.
    share(0.01)
    start = time.monotonic()
    handle = start_background(
        str(tmp_path),
        lambda: write_staged_rank_file(memory, str(tmp_path), "b.safetensors", tensors, METADATA),
        lambda e: e,
    )
    time.sleep(0.2)
    assert not handle.done()
    assert handle.wait() == unpaced
    assert time.monotonic() - start < 1.5
    wait_for_saves()  # the in-flight slot is free again for the next test
    assert sha256_file(tmp_path / "b.safetensors") == unpaced


@pytest.mark.parametrize("bad", [0, -0.5, 1.5, math.nan, "0.5", True])
def test_a_share_outside_0_to_1_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match=r"must be a number in \(0, 1\], not .*pass 1\.0"):
        set_writer_share(bad)  # type: ignore[arg-type]
    assert writer_share() == WRITER_SHARE
