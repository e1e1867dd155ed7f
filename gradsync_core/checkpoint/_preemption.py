"""Save before a scheduler's kill: SIGTERM, then a save at the next step boundary, then exit.

Schedulers (Slurm, Kubernetes, TPU and spot preemption) send SIGTERM some seconds before
SIGKILL. A signal reaches each rank at its own moment, inside whichever step it is running;
saving from the signal handler would save half a step, and each rank another step. So the
handler only sets a flag, and the training loop asks at every step boundary
(``should_save(step)``): the ranks exchange their flag and step number (one tiny collective
over the training group, in the loop's own thread, so in the same order as training's), and
all of them learn at the same boundary that some rank was signalled. They save that step,
wait for the save, and exit with ``PREEMPTED_EXIT`` (143, ``128 + SIGTERM``: what a shell
reports for a process SIGTERM ended, so a scheduler that requeues on it still does).

The executors give the exchange (``gradsync_torch.PreemptionHandler``: an all-gather on a
process group; ``gradsync_jax.PreemptionHandler``: one over the JAX processes).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from types import FrameType, TracebackType
from typing import Any, NoReturn

from gradsync_core.checkpoint._background import wait_for_saves

PREEMPTED_EXIT = 128 + signal.SIGTERM  # 143
_log = logging.getLogger(__name__)


class PreemptionHandler:
    """On SIGTERM, save at the next step boundary, on every rank at the same step, and exit.

    A context manager: it installs the signal handler on entry (in the main thread) and puts
    the previous one back on exit. ``exchange`` is the executor's collective: every rank's
    ``[signalled, step]``, in rank order.

    Example:
        >>> with gradsync_torch.PreemptionHandler() as preemption:  # doctest: +SKIP
        ...     for step in range(start, steps):
        ...         train_step()
        ...         if preemption.should_save(step):
        ...             opt.save(path, model=net, blocking=False)
        ...             preemption.exit()  # waits for the save, exits with status 143
    """

    def __init__(
        self,
        exchange: Callable[[list[int]], Sequence[Sequence[int]]],
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        exit_code: int = PREEMPTED_EXIT,
    ) -> None:
        self._exchange = exchange
        self.signals = tuple(signals)
        self.exit_code = exit_code
        self.signalled: int | None = None  # the signal this process received, if any
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptionHandler:
        if threading.current_thread() is not threading.main_thread():
            raise ValueError(
                "PreemptionHandler must be entered in the main thread (Python runs signal "
                "handlers there); enter it around the training loop of the main thread"
            )
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        for sig, previous in self._previous.items():
            # None: the previous handler was not installed from Python (JAX's preemption
            # notifier installs one in C++), and cannot be put back; the default then.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signalled is None:
            _log.warning("received signal %d: saving at the next step boundary", signum)
        self.signalled = signum

    def should_save(self, step: int) -> bool:
        """Whether any rank was signalled: the same answer on every rank (a collective; call
        it on every rank at every step boundary, with the step just finished).

        Raises:
            ValueError: the ranks passed different steps (they would save different ones).
        """
        mine = [int(self.signalled is not None), int(step)]
        rows = [list(row) for row in self._exchange(mine)]
        steps = sorted({row[1] for row in rows})
        if len(steps) > 1:
            raise ValueError(
                f"PreemptionHandler.should_save was called at different steps on the ranks "
                f"({', '.join(map(str, steps))}); call it at every step boundary on every "
                "rank with the same step number"
            )
        return any(row[0] for row in rows)

    def exit(self) -> NoReturn:
        """Wait for the save in flight, then exit with ``exit_code`` (143 by default).

        Raises:
            CheckpointError: the save failed (the exit status is then 1, an uncaught error).
        """
        wait_for_saves()
        sys.stdout.flush()
        raise SystemExit(self.exit_code)
