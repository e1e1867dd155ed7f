"""INFO records around the compilations of the jitted steps (silent unless logging is set up).

A step's first call traces, lowers and compiles its program: seconds on a small model, tens
of seconds on GPT-2, before anything is printed. Each step logs, through its own module's
``logging.getLogger(__name__)``, ``compiling <what> for N parameters (E elements)`` when JAX
traces it (which it does exactly when it compiles anew) and ``compiled <what> in T s`` when
that call returns (tracing, lowering, compiling and dispatching the first run; a failed
compilation logs its time too, then raises). gradsync adds
no handler and sets no level: ``logging.basicConfig(level=logging.INFO)`` shows them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np


class CompileLog:
    """The two records of one jitted function's compilations.

    ``call(fn, *args)`` runs the jitted ``fn``; ``fn`` calls ``tracing(params)`` while it is
    traced. A call under an outer trace (``jax.eval_shape``, the caller's ``jit``) compiles
    nothing by itself and logs nothing.
    """

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self.logger, self.what = logger, what
        self._armed = False
        self._start: float | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, with the two records if it compiled."""
        traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args))
        self._armed = not traced and self.logger.isEnabledFor(logging.INFO)
        try:
            return fn(*args)
        finally:
            if self._start is not None:
                seconds = time.perf_counter() - self._start
                self.logger.info("compiled %s in %.1f s", self.what, seconds)
            self._armed, self._start = False, None

    def tracing(self, params: Any) -> None:
        """Record that ``what`` is being compiled for ``params`` (called while tracing)."""
        if not self._armed:
            return
        leaves = jax.tree.leaves(params)
        elements = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in leaves)
        self.logger.info(
            "compiling %s for %d parameters (%s elements)", self.what, len(leaves), f"{elements:,}"
        )
        self._start = time.perf_counter()
