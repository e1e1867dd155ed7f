"""The writer process: it writes a background save's rank files outside training's interpreter.

A save with ``blocking=False`` copies this rank's tensors into host staging memory and returns;
the bytes are then written and hashed while training goes on. Written by a thread of the
training process, they slowed the training more: measured on the same bytes, the steps during
the write ran 1.23x a quiet step with a writer thread and 1.09x with a writer process, at the
same blocked time (benchmarks/async_save.py, "writer alone"; why is not measured: ``hashlib``
and ``write`` release the interpreter lock for each slice, the thread takes it between them).
So an executor may stage into ``SharedStaging`` and have ``write_staged_rank_file`` write from
it here (docs/design-checkpoints.md §9, "Saves that do not stop training"; torch's saves do).

- **One process per training process**, started at its first staged write and kept: a fresh
  interpreter (``subprocess``: fork-and-exec, never a fork of a process holding gloo's or
  XLA's threads; not ``multiprocessing``, which would run the user's ``__main__`` again) that
  imports nothing but this standard-library package, at niceness ``WRITER_NICE``.
- **The staging memory is shared**, not sent: ``SharedStaging`` maps anonymous shared memory
  (``memfd_create``) once, grown only when a save needs more; the writer maps the same pages
  (the descriptor passed over the socket), so a save sends only where each tensor lies.
- **Its death is a failure, never a hang**: a request is a message on a socket pair and its
  answer another; a writer that dies (killed, out of memory) closes its end, the answer is an
  end of file, and the write raises, which the save agrees like any failed write (every rank
  hears it). The next save starts a new writer. The writer in turn ends when the training
  process does (its end of the socket closes) and ignores SIGINT and SIGTERM, which a terminal
  or a scheduler sends to the whole job: the training process decides when a save ends, as it
  does for its writer thread.
- **It writes as the rank would**: each request carries the rank's umask and file-size limit
  (``RLIMIT_FSIZE``) of the moment, which the writer takes before writing; the save points
  ``before_file`` and ``after_file`` still run in the training process, around the request.
- **Around the page cache** (``write_atomic(..., direct=True)``: ``O_DIRECT`` where the file
  system takes it, the same bytes): on cores the training keeps busy, the write's CPU is the
  training's loss, and a cached write spends more of it (the copy into the cache, the
  kernel's writeback, freeing the pages when the version is removed): with it the
  benchmark's steps during a save went from 1.20-1.27x to 1.10-1.16x a quiet step
  (docs/checkpoints.md, "Measured").
- **Paced** (``set_writer_share``): what the write still costs the training is the CPU it
  spends (mostly the hash), so the writer spends at most ``WRITER_SHARE`` of one core, sleeping
  between slices, and the same CPU is spread over more training steps, each losing less;
  whoever waits for the save (``SaveHandle.wait``, ``wait_for_saves``) sends ``("hurry",)``
  over the socket and the rest of the file is written at full speed.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import mmap
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle
from typing import Any

from gradsync_core.checkpoint._background import WRITER_NICE, on_wait
from gradsync_core.checkpoint._safetensors import DTYPE_BYTES, TensorBytes, tensor_file
from gradsync_core.checkpoint._save_hooks import run_hook
from gradsync_core.checkpoint._storage import _SLICE_BYTES, current_umask, write_atomic

try:
    import resource
except ImportError:  # not a POSIX system: no file-size limit to pass on
    resource = None  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class StagedTensor:
    """One tensor of a rank file, as it lies in ``SharedStaging``: its key, safetensors dtype
    (``"F32"``), shape and the byte offset of its C-ordered bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        """Its bytes in the staging memory."""
        count = 1
        for size in self.shape:
            count *= size
        return count * DTYPE_BYTES[self.dtype]


class SharedStaging:
    """Host memory the writer process reads: one shared mapping, allocated at the first save
    that stages into it, reused by every later one, replaced only by a larger one."""

    def __init__(self) -> None:
        self._map: mmap.mmap | None = None
        self._fd = -1  # its descriptor, which the writer maps

    @property
    def nbytes(self) -> int:
        """Bytes mapped (0 before the first save without blocking)."""
        return 0 if self._map is None else len(self._map)

    @property
    def mapping(self) -> tuple[mmap.mmap, int]:
        """The mapping (``reserve`` made it) and its descriptor.

        Raises:
            RuntimeError: nothing was reserved yet.
        """
        if self._map is None:
            raise RuntimeError("no staging memory is reserved yet; call reserve() first")
        return self._map, self._fd

    def reserve(self, nbytes: int) -> mmap.mmap:
        """The mapping, at least ``nbytes`` long (a new one if the current one is smaller:
        the views of the old one stay valid until they are dropped, then it is unmapped).
        Call only while no save is in flight: its bytes are overwritten."""
        if self._map is None or len(self._map) < nbytes:
            self._map = None  # ours goes before the new one is made
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            self._fd = _shared_memory(max(nbytes, 1))
            self._map = mmap.mmap(self._fd, max(nbytes, 1))
        return self._map


def _shared_memory(nbytes: int) -> int:
    """A descriptor of ``nbytes`` of shared memory with no name (nothing to remove after a
    crash; the memory goes with the last process that maps it)."""
    try:
        fd = os.memfd_create("gradsync-staging", os.MFD_CLOEXEC)
    except (AttributeError, OSError):  # not Linux, or refused (a sandbox): an unlinked file
        where = "/dev/shm" if os.path.isdir("/dev/shm") else None  # in memory where it can
        fd, name = tempfile.mkstemp(prefix="gradsync-staging-", dir=where)
        os.unlink(name)
    try:
        os.ftruncate(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


# The share of one core the writer process spends on a rank file by default: its CPU time at
# most this fraction of the write's wall time (``set_writer_share``). On 2 cores busy with 2
# training ranks (docs/checkpoints.md, "Measured"), the median step during the write went from
# 1.08-1.12x a quiet step unpaced to 1.04-1.08x at 0.25 (0.4: no change measured), the save
# from 0.9 to 1.5 s of wall time.
WRITER_SHARE = 0.25
_share = WRITER_SHARE


def set_writer_share(share: float) -> None:
    """Pace this process's background writes: the writer process spends at most ``share`` of
    one core on a rank file (its CPU time over the write's wall time): after each slice of
    ``_SLICE_BYTES`` it sleeps ``(1 - share) / share`` times the CPU time the slice took, so
    the training steps during the write each lose less, over more of them; ``1.0``: unpaced.
    Whoever waits for the save (``wait()``, the next save, ``wait_for_saves``, a
    preemption's ``exit()``) lifts the pace for the rest of that write. The writes that begin
    after the call use it.

    Args:
        share: in (0, 1]; ``WRITER_SHARE`` until set.

    Raises:
        ValueError: ``share`` is not in (0, 1].
    """
    global _share
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
        raise ValueError(
            f"the writer's share of a core must be a number in (0, 1], not {share!r}; "
            f"pass 1.0 for a writer that is not paced"
        )
    _share = float(share)


def writer_share() -> float:
    """The share of one core the writer process spends on a rank file (``set_writer_share``)."""
    return _share


class Paced:
    """One write's pace: after each slice written, sleep so that the writer's CPU time stays
    at most ``share`` of the wall time; a ``("hurry",)`` message on ``conn`` (someone waits
    for the save; an end of file: the training process is gone) ends the pacing."""

    def __init__(self, share: float, conn: Connection | None = None) -> None:
        self.share, self.conn = share, conn

    def chunks(self, chunks: Sequence[Any]) -> Iterator[Any]:
        """``chunks`` in slices of at most ``_SLICE_BYTES``, paced between them."""
        cpu = time.thread_time()
        for chunk in chunks:
            view = memoryview(chunk).cast("B")
            for start in range(0, len(view), _SLICE_BYTES):
                yield view[start : start + _SLICE_BYTES]
                if self.share < 1:
                    self._rest(time.thread_time() - cpu)
                    cpu = time.thread_time()

    def _rest(self, worked: float) -> None:
        pause = worked * (1 - self.share) / self.share
        if self.conn is None:
            time.sleep(pause)
        elif self.conn.poll(pause):  # hurried, or the training process is gone
            with contextlib.suppress(EOFError, OSError):
                self.conn.recv()
            self.share = 1.0


class _WriterProcess:
    """This process's writer: started at the first write, replaced when it dies."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # one write at a time
        self._send = threading.Lock()  # one message at a time (``hurry`` sends from another)
        self._proc: subprocess.Popen[bytes] | None = None
        self._conn: Connection | None = None
        self._mapped: mmap.mmap | None = None  # the staging memory the writer has mapped
        self._unhurried = False  # a write is unanswered and not yet hurried

    @property
    def pid(self) -> int | None:
        """The writer's process id (``None``: none is running)."""
        return None if self._proc is None else self._proc.pid

    def write(
        self,
        memory: SharedStaging,
        path: str,
        tensors: Sequence[StagedTensor],
        metadata: Mapping[str, str],
    ) -> str:
        """Have the writer write the rank file ``path`` from ``memory``; its sha256 (hex).

        Raises:
            OSError, ValueError: the write failed in the writer (as it would have here).
            RuntimeError: the writer died before it answered.
        """
        staged, fd = memory.mapping
        with self._lock:
            if self._proc is None:
                self._start()
            assert self._proc is not None and self._conn is not None
            limit = resource.getrlimit(resource.RLIMIT_FSIZE) if resource is not None else None
            request = ("write", os.path.abspath(path), list(tensors), dict(metadata))
            try:
                with self._send:
                    if self._mapped is not staged:
                        self._conn.send(("memory", len(staged)))
                        send_handle(self._conn, fd, self._proc.pid)
                        self._mapped = staged
                    share = _share
                    self._conn.send((*request, current_umask(), limit, share))
                    self._unhurried = share < 1
                answer, value = self._conn.recv()
            except (EOFError, OSError) as e:  # its end closed: it died
                pid, status = self._end(wait_s=10)
                raise RuntimeError(_died(pid, status, path)) from e
            except BaseException:  # the exchange broke off: the writer is not trusted again
                self._end(wait_s=0)
                raise
            finally:
                with self._send:
                    self._unhurried = False
        if answer == "failed":
            raise value
        return str(value)

    def hurry(self) -> None:
        """Have the write in flight, if any, go on at full speed, unpaced (someone waits for
        it), once per write; a writer that is gone or answering meanwhile is left to
        ``write``."""
        with self._send:
            if self._unhurried and self._conn is not None:
                self._unhurried = False
                with contextlib.suppress(OSError):
                    self._conn.send(("hurry",))

    def _start(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-I", "-c", _CHILD, root, str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # its errors go back as answers; a crash to stderr
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._mapped = None

    def _end(self, wait_s: float) -> tuple[int, int]:
        """Close our end (the writer reads the end of file and returns), give it ``wait_s``
        seconds to end, else kill it; its pid and exit status."""
        proc, self._proc = self._proc, None
        with self._send:
            if self._conn is not None:
                self._conn.close()
            self._conn, self._mapped, self._unhurried = None, None, False
        assert proc is not None
        try:
            return proc.pid, proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.pid, proc.wait()

    def stop(self) -> None:
        """End the writer (at interpreter exit: after the save in flight, whose thread the
        interpreter joined first)."""
        with self._lock:
            if self._proc is not None:
                self._end(wait_s=10)

    def forget(self) -> None:
        """In a child forked from this process: the writer is the parent's, not ours."""
        self._lock, self._send = threading.Lock(), threading.Lock()
        if self._conn is not None:
            with contextlib.suppress(OSError):
                os.close(self._conn.fileno())
        self._proc, self._conn, self._mapped, self._unhurried = None, None, None, False


def _died(pid: int, status: int, path: str) -> str:
    """Why a writer stopped answering, in words."""
    ended = (
        f"killed by {signal.Signals(-status).name}"
        if status < 0 and -status in signal.valid_signals()
        else f"exit status {status}"
    )
    return (
        f"the save's writer process (pid {pid}) ended ({ended}) before it finished "
        f"{os.path.basename(path)}; the next save starts a new one"
    )


# The writer's program: this file's ``serve`` under the parent's interpreter and package.
_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from gradsync_core.checkpoint._writer_process import serve; serve(int(sys.argv[2]))"
)

WRITER = _WriterProcess()
on_wait(WRITER.hurry)
if hasattr(os, "register_at_fork"):  # POSIX
    os.register_at_fork(after_in_child=WRITER.forget)
# After the interpreter joined the save's thread (it is not a daemon): the writer ends.
atexit.register(WRITER.stop)


def write_staged_rank_file(
    memory: SharedStaging,
    staging: str,
    name: str,
    tensors: Sequence[StagedTensor],
    metadata: Mapping[str, str],
) -> str:
    """Write one rank file into ``staging`` from ``memory``, in the writer process, as
    ``write_rank_file`` writes it here (atomically, hashed as written, at the same save
    points); return its sha256 (hex).

    Raises:
        OSError, ValueError: the write failed.
        RuntimeError: the writer process died before it answered.
    """
    run_hook("before_file")
    digest = WRITER.write(memory, os.path.join(staging, name), tensors, metadata)
    run_hook("after_file")
    return digest


def serve(fd: int) -> None:
    """The writer process's loop: map the staging memory it is sent, write the rank files it
    is asked for, answer each; return when the training process closes its end."""
    for ignored in (signal.SIGINT, signal.SIGTERM):
        signal.signal(ignored, signal.SIG_IGN)
    with contextlib.suppress(OSError, AttributeError):  # Linux and macOS only
        os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)
    conn = Connection(fd)
    memory: mmap.mmap | None = None
    while True:
        try:
            message = conn.recv()
        except EOFError:
            return
        if message[0] == "hurry":  # for a write that has ended meanwhile
            continue
        if message[0] == "memory":
            received = recv_handle(conn)
            try:
                memory = mmap.mmap(received, message[1], access=mmap.ACCESS_READ)
            finally:
                os.close(received)
            continue
        _, path, tensors, metadata, umask, limit, share = message
        try:
            assert memory is not None, "no staging memory was sent"
            paced = Paced(share, conn)
            answer: tuple[str, Any] = (
                "done",
                _write(memory, path, tensors, metadata, umask, limit, paced),
            )
        except Exception as e:  # the training process raises it
            answer = ("failed", _sendable(e))
        try:
            conn.send(answer)
        except OSError:  # the training process is gone
            return


def _write(
    memory: mmap.mmap,
    path: str,
    tensors: Sequence[StagedTensor],
    metadata: Mapping[str, str],
    umask: int,
    limit: tuple[int, int] | None,
    paced: Paced,
) -> str:
    """One rank file from ``memory``, under the training process's umask and size limit,
    ``paced``."""
    os.umask(umask)
    if limit is not None and resource is not None:
        with contextlib.suppress(ValueError, OSError):  # a hard limit only root may raise
            resource.setrlimit(resource.RLIMIT_FSIZE, limit)
    view = memoryview(memory)
    parts = [
        TensorBytes(t.key, t.dtype, t.shape, view[t.offset : t.offset + t.nbytes]) for t in tensors
    ]
    digest = hashlib.sha256()
    write_atomic(path, paced.chunks(tensor_file(parts, metadata)), digest=digest, direct=True)
    return digest.hexdigest()


def _sendable(error: Exception) -> Exception:
    """``error`` as the training process can receive it: a built-in exception as it is (an
    ``OSError`` keeps its number, words and file name: the save's sentence is the one a
    writer thread gives), any other as a ``RuntimeError`` with its type and words (its class
    may not exist in the training process)."""
    if type(error).__module__ == "builtins":
        return error
    return RuntimeError(f"{type(error).__name__}: {error}")
