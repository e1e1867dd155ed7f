"""Spawned workers of ``test_async_torch_faults.py``: saves with ``blocking=False`` that a
killed rank, a full disk, a raising writer or a second save meet while the background writes.

Every run trains the 2-rank ZeRO-1 Adam of ``tests/torch/async_save_checks.py`` beside its
plain Adam reference, saves (blocking) after ``SAVED_STEPS`` steps, trains ``MORE_STEPS``
more, and meets the fault in the next save, made with ``blocking=False``. The workers return
the reference state at the first save; the test loads what each path holds at world size 1
and in JAX and compares it bitwise.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from gradsync_core import CheckpointError, wait_for_saves
from gradsync_core.checkpoint import save_hook
from tests.torch.async_save_checks import linear_stack, pair, reference_state
from tests.torch.zero_helpers import Pair, plain, zero

SAVED_STEPS, MORE_STEPS = 3, 2
DIED = 17
_HOOKS = contextlib.ExitStack()  # the hooks of a rank killed on purpose, never closed

# Where a rank dies in the background half of the second save: (rank, save point).
KILL_POINTS: dict[str, tuple[int, str]] = {
    "before its rank file": (1, "before_file"),
    "before the manifest": (0, "before_manifest"),
}


def _trained(world_size: int, path: str) -> tuple[Any, dict[str, np.ndarray]]:
    """A run saved (blocking) at ``path`` after ``SAVED_STEPS`` steps and trained
    ``MORE_STEPS`` more; the reference state of that save."""
    run = pair(world_size)
    for _ in range(SAVED_STEPS):
        run.step()
    run.opt.save(path)
    saved = reference_state(run)
    for _ in range(MORE_STEPS):
        run.step()
    return run, saved


def crash_in_background(rank: int, world_size: int, path: str, point: str) -> dict[str, Any]:
    """Die at ``point`` of the background half of a save; the survivor's ``wait()`` says
    what it raised and how long it took to hear of it."""
    run, saved = _trained(world_size, path)
    dying, save_point = KILL_POINTS[point]
    if rank == dying:
        _HOOKS.enter_context(save_hook(save_point, lambda: os._exit(DIED)))
    handle = run.opt.save(path, blocking=False)
    start = time.monotonic()
    try:
        handle.wait(timeout=60)
    except CheckpointError as e:
        return {"raised": str(e), "seconds": time.monotonic() - start, "saved": saved}
    return {"raised": None, "seconds": time.monotonic() - start, "saved": saved}


def _disk_full() -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def _writer_breaks() -> None:
    raise RuntimeError("the writer broke")


@contextlib.contextmanager
def _failing(rank: int, failing: int, point: str, action: Any) -> Any:
    with save_hook(point, action) if rank == failing else contextlib.nullcontext():
        yield


def failures_in_background(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A full disk (raised at ``wait()``, and unwaited, at the next save), a raising writer,
    and a second save made while the first writes; what every rank raised, the reference
    states, and how long the second save waited."""
    out: dict[str, Any] = {"messages": {}}
    full = os.path.join(root, "disk-full")
    run, out["saved"] = _trained(world_size, full)

    with _failing(rank, 1, "before_file", _disk_full):
        handle = run.opt.save(full, blocking=False)
        with pytest.raises(CheckpointError) as raised:
            handle.wait(timeout=60)
    out["messages"]["disk full, at wait()"] = str(raised.value)
    if rank == 1:
        assert isinstance(raised.value.__cause__, OSError)

    unwaited = os.path.join(root, "disk-full-unwaited")
    run.opt.save(unwaited)  # blocking: the previous checkpoint of this path
    out["unwaited"] = reference_state(run)
    with _failing(rank, 1, "before_file", _disk_full):
        run.opt.save(unwaited, blocking=False)
        run.step()  # training goes on; nobody waits
        with pytest.raises(CheckpointError) as raised:
            run.opt.save(unwaited)  # the next save raises it, and does not start
    out["messages"]["disk full, at the next save"] = str(raised.value)
    run.opt.save(os.path.join(root, "after"), blocking=False).wait(timeout=60)  # raised once

    broke = os.path.join(root, "writer-raises")
    with _failing(rank, 0, "after_file", _writer_breaks):
        handle = run.opt.save(broke, blocking=False)
        with pytest.raises(CheckpointError) as raised:
            handle.wait(timeout=60)
    out["messages"]["the writer raises"] = str(raised.value)
    assert not os.path.lexists(broke)

    # A second save while the first writes: it waits for the first (the staging buffer the
    # first is writing from is not overwritten), then both hold their own states.
    first, second = os.path.join(root, "first"), os.path.join(root, "second")
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(10)):
        handle = run.opt.save(first, blocking=False)
        out["first"] = reference_state(run)
        run.step()
        threading.Timer(1.0, release.set).start()
        start = time.monotonic()
        later = run.opt.save(second, blocking=False)
        out["second waited"] = time.monotonic() - start
        assert handle.done(), "the second save started before the first ended"
    out["second"] = reference_state(run)
    run.step()
    later.wait(timeout=60)
    handle.wait()
    return out


def writer_pids() -> list[int]:
    """The pids of this process's save writer processes (its children running
    ``gradsync_core.checkpoint._writer_process``)."""
    children: list[int] = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            children += [int(pid) for pid in f.read().split()]
    found = []
    for pid in children:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"gradsync_core.checkpoint._writer_process" in f.read():
                    found.append(pid)
        except FileNotFoundError:  # ended meanwhile
            pass
    return found


def _kill_writer() -> None:
    (pid,) = writer_pids()
    os.kill(pid, signal.SIGKILL)
    while os.path.exists(f"/proc/{pid}/cmdline") and _state(pid) not in ("Z", "X"):
        time.sleep(0.01)  # dead before the rank asks it to write


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return "X"


def writer_killed(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Rank 1's writer process is killed (SIGKILL) as its rank file is due: every rank's
    ``wait()`` raises one sentence, the path keeps the previous checkpoint (whose reference
    state this returns), and the next save starts a new writer and completes."""
    path = os.path.join(root, "writer-killed")
    run, saved = _trained(world_size, path)
    run.opt.save(os.path.join(root, "first"), blocking=False).wait(timeout=60)
    first = writer_pids()
    with _failing(rank, 1, "before_file", _kill_writer):
        handle = run.opt.save(path, blocking=False)
        run.step()  # training goes on beside the dying writer
        with pytest.raises(CheckpointError) as raised:
            handle.wait(timeout=60)
    after = os.path.join(root, "after")
    run.opt.save(after, blocking=False).wait(timeout=60)
    return {
        "raised": str(raised.value),
        "saved": saved,
        "writers": (first, writer_pids()),
        "after": reference_state(run),
    }


# A real write that fails: rank 1's files may not grow past this (RLIMIT_FSIZE), and its rank
# file of BIG_SIZES' Adam state is 2 MiB; nothing else the rank writes comes near it.
FILE_LIMIT = 1 << 20
BIG_SIZES = (16, 512, 512, 512, 8)  # two 512 x 512 weights: one per rank


def file_too_large(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """A background write that the kernel stops (``EFBIG``: rank 1's file passes its size
    limit, the failure of a disk filling up under the write, for real): every rank's
    ``wait()`` raises one sentence, the half-written file is gone with the staging directory,
    and the path keeps the previous checkpoint (whose reference state this returns)."""
    import resource
    import signal

    run = Pair(
        world_size,
        zero(torch.optim.Adam, lr=1e-2),  # the JAX load's optax.adam(1e-2)
        plain(torch.optim.Adam, lr=1e-2),
        model=linear_stack(*BIG_SIZES),
    )
    path = os.path.join(root, "too-large")
    for _ in range(SAVED_STEPS):
        run.step()
    run.opt.save(path, blocking=False).wait(timeout=60)  # the background group exists
    saved = reference_state(run)
    run.step()
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    if rank == 1:  # a write past the limit fails with EFBIG instead of killing the process
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_LIMIT, hard))
    try:
        handle = run.opt.save(path, blocking=False)
        run.step()  # training goes on beside the failing write
        with pytest.raises(CheckpointError) as raised:
            handle.wait(timeout=60)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    leftovers = sorted(n for n in os.listdir(root) if ".tmp-" in n)  # a staging directory
    return {"raised": str(raised.value), "saved": saved, "leftovers": leftovers}


def soak(rank: int, world_size: int, root: str, saves: int) -> dict[str, Any]:
    """``saves`` saves with ``blocking=False`` to one path, a training step between each, of
    about 1 MiB of Adam state per rank; the process's RSS, descriptors and threads after the
    first tenth, half and all of them (each after ``wait_for_saves``: nothing in flight)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.Tanh(), nn.Linear(512, 512), nn.Linear(512, 8))
    run = Pair(
        world_size,
        zero(torch.optim.Adam, lr=1e-3),
        plain(torch.optim.Adam, lr=1e-3),
        model=model,
    )
    path = os.path.join(root, "soak")
    seen = {}
    for i in range(saves):
        run.step()
        run.opt.save(path, blocking=False)
        if i + 1 in (saves // 10, saves // 2, saves):
            wait_for_saves()
            seen[i + 1] = {
                "rss": _rss_bytes(),
                "fds": len(os.listdir("/proc/self/fd")),
                "threads": threading.active_count(),
                "os threads": len(os.listdir("/proc/self/task")),
            }
    return seen


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")
