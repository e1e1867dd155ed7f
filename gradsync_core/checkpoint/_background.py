"""The save in flight: at most one per process, its failure never lost (docs/design.md §9).

A save with ``blocking=False`` returns once this rank's bytes are copied to host staging
buffers; a background thread writes the files (or has the writer process write them:
``_writer_process``, torch's saves) and runs the rest of the switching save (``start_save``
in ``_save_protocol``). This module owns what that thread leaves behind:

- **at most one save in flight** per process. Every save, blocking or not, first waits for
  the one in flight (``wait_for_saves``), as Orbax's ``AsyncCheckpointer`` does: the staging
  buffers the next save copies into are free again, and saves reach the disk in the order
  they were made;
- **a failure is raised, never dropped**: at ``SaveHandle.wait()``, else at the next save,
  else at interpreter exit, where the sentence goes to stderr and the process exits with
  status ``SAVE_FAILED_EXIT`` instead of 0 (a job must not "exit 0 having written no
  checkpoint", VeOmni PR #1162). The writer is not a daemon thread, so an interpreter that
  exits with a save in flight finishes the save first.

Process-wide, as the thing it guards is: one process's staging memory and its order of saves.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

# The exit status of an interpreter that ends with a background save's failure unraised:
# what an uncaught CheckpointError would give.
SAVE_FAILED_EXIT = 1

_log = logging.getLogger(__name__)


class SaveHandle:
    """A save running in the background (``blocking=False``); ``wait()`` for its end.

    Every rank's handle ends alike: the ranks agree on the outcome as a blocking save does, so
    ``wait()`` returns the same manifest, or raises the same ``CheckpointError`` sentence, on
    every rank. ``started`` and ``ended`` are ``time.monotonic()`` at the call and at the
    save's end (written and switched, or failed; ``None`` while it runs): its wall time.

    Example:
        >>> handle = opt.save("ckpt", blocking=False)  # doctest: +SKIP
        >>> manifest = handle.wait()  # doctest: +SKIP
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = time.monotonic()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: Any = None
        self._error: BaseException | None = None
        self._reported = False
        self.ended: float | None = None  # time.monotonic() at its end; None while it runs

    def done(self) -> bool:
        """Whether the save has ended (written and switched, or failed)."""
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the save has ended and return its manifest.

        Args:
            timeout: seconds to wait at most (``None``: until it ends).

        Returns:
            The manifest written (``gradsync_core.Manifest``), the same on every rank.

        Raises:
            CheckpointError: the save failed (on every rank, with one sentence); ``path``
                then still names the previous checkpoint.
            TimeoutError: it has not ended after ``timeout`` seconds.
        """
        if not self._done.is_set() and (timeout is None or timeout > 0):
            _hurry()  # a wait, not a look
        if not self._done.wait(timeout):
            raise TimeoutError(f"the save of {self.path} is still writing after {timeout} s")
        self._join()
        if self._error is not None:
            self._reported = True
            raise self._error
        return self._result

    def _finish(self, result: Any, error: BaseException | None) -> None:
        self._result, self._error = result, error
        self.ended = time.monotonic()
        self._done.set()

    def _join(self) -> None:
        """Once done: the writer thread has ended too (it does nothing after ``_finish``)."""
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()


_lock = threading.Lock()
_in_flight: SaveHandle | None = None
_local = threading.local()  # .background: this thread is a save's background writer
_exit_check_registered = False


# What a wait for a save in flight calls first: a writer paced to spare the training
# (``_writer_process.set_writer_share``) then writes the rest at full speed, since whoever
# waits is no longer training.
_hurry_hooks: list[Callable[[], None]] = []


def on_wait(hook: Callable[[], None]) -> None:
    """Call ``hook()`` whenever someone starts waiting for a save in flight (``wait()``,
    ``wait_for_saves``)."""
    _hurry_hooks.append(hook)


def _hurry() -> None:
    for hook in _hurry_hooks:
        hook()


def in_background() -> bool:
    """Whether the calling thread is a save's background writer."""
    return getattr(_local, "background", False)


def wait_for_saves() -> Any:
    """Wait for this process's save in flight, if any (the in-flight rule); call before
    any save, or before ending the process group that save agrees over.

    Returns:
        The manifest of the save waited for, or ``None`` if none was in flight.

    Raises:
        CheckpointError: that save failed and no ``wait()`` has raised it yet.
    """
    global _in_flight
    with _lock:
        handle, _in_flight = _in_flight, None
    if handle is None:
        return None
    if not handle._done.is_set():
        _hurry()
    handle._done.wait()
    handle._join()
    if handle._error is not None and not handle._reported:
        return handle.wait()  # raises, once
    return handle._result


def start_background(
    path: str, run: Callable[[], Any], wrap: Callable[[BaseException], BaseException]
) -> SaveHandle:
    """Start ``run()`` (the rest of a save) in a background thread and make it the save in
    flight; the caller has waited for the previous one. A failure is kept as ``wrap(error)``.

    Returns:
        The save's handle.
    """
    global _in_flight, _exit_check_registered
    handle = SaveHandle(path)

    def writer() -> None:
        _local.background = True
        _lower_priority()
        result, error = None, None
        try:
            result = run()
        except BaseException as e:  # kept for wait(), the next save and the exit check
            error = wrap(e)
        if error is None:
            _log.info("checkpoint %s: background save done in %.2f s", path, _elapsed(handle))
        handle._finish(result, error)

    thread = threading.Thread(target=writer, name=f"gradsync save {path}", daemon=False)
    handle._thread = thread
    with _lock:
        if _in_flight is not None:
            raise RuntimeError("a save is already in flight; wait_for_saves() first")
        _in_flight = handle
        if not _exit_check_registered:
            atexit.register(_check_at_exit)
            _exit_check_registered = True
    thread.start()
    return handle


# The writer thread's niceness: it yields the CPU to training (the scheduler then gives it
# the time training leaves, mostly while the ranks wait in their collectives).
WRITER_NICE = 19


def _lower_priority() -> None:
    """Lower the calling thread's scheduling priority to ``WRITER_NICE`` where the system
    sets priorities per thread (Linux); elsewhere leave it as it is."""
    if not sys.platform.startswith("linux"):
        return
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(os.getpriority(os.PRIO_PROCESS, tid), WRITER_NICE))
    except OSError:  # not permitted: the default priority
        pass


def _elapsed(handle: SaveHandle) -> float:
    return time.monotonic() - handle.started


def _check_at_exit() -> None:
    """At interpreter exit (the writer thread already joined: it is not a daemon): a failure
    nobody raised is printed and makes the exit status ``SAVE_FAILED_EXIT``."""
    with _lock:
        handle = _in_flight
    if handle is None:
        return
    handle._done.wait()
    if handle._error is None or handle._reported:
        return
    try:
        print(
            f"gradsync: a background save failed and the program ended without waiting for "
            f"it: {handle._error}",
            file=sys.stderr,
        )
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        # An exception in an atexit function is printed and ignored (the status stays 0);
        # only leaving here sets the status.
        os._exit(SAVE_FAILED_EXIT)
