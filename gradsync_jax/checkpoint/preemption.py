"""Save before a scheduler's kill, in JAX.

``gradsync_core``'s ``PreemptionHandler`` whose step-boundary exchange gathers
``[signalled, step]`` from every JAX process.

The exchange runs in the training loop's thread between steps, so a device collective
(``process_allgather``) meets every process in the same order as training's; with one
process there is nothing to exchange. While the handler is entered it replaces JAX's own
SIGTERM notifier (the preemption service of ``jax.distributed``, which
``multihost_utils.reached_preemption_sync_point`` reads); on exit that one, installed in C++,
cannot be put back, and SIGTERM's default action is restored instead.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils

from gradsync_core.checkpoint import PREEMPTED_EXIT
from gradsync_core.checkpoint import PreemptionHandler as _CorePreemptionHandler


def _exchange(mine: list[int]) -> list[list[int]]:
    if jax.process_count() == 1:
        return [mine]
    rows = np.asarray(multihost_utils.process_allgather(np.asarray(mine, np.int32)))
    return rows.reshape(jax.process_count(), -1).tolist()


class PreemptionHandler(_CorePreemptionHandler):
    """On SIGTERM, every JAX process saves at the same step boundary and exits with status
    143 (docs/checkpoints.md, "Preemption").

    Args:
        signals: the signals that ask for a save (default SIGTERM, what schedulers send).
        exit_code: the status ``exit()`` ends the process with (``PREEMPTED_EXIT``, 143).

    Example:
        >>> with PreemptionHandler() as preemption:  # doctest: +SKIP
        ...     for step in range(steps):
        ...         params, opt_state = train_step(params, opt_state, batch)
        ...         if preemption.should_save(step):
        ...             save_optimizer_state(path, tx, opt_state, params, step=step,
        ...                                  blocking=False)
        ...             preemption.exit()
    """

    def __init__(
        self, *, signals: Sequence[int] = (signal.SIGTERM,), exit_code: int = PREEMPTED_EXIT
    ) -> None:
        super().__init__(_exchange, signals=signals, exit_code=exit_code)
