"""Run as a script by ``test_async_jax_faults.py``: load the checkpoint at PATH, change every
state leaf and save it again with ``blocking=False``, then, by MODE:

- ``die-POINT``: exit at save point POINT of the background write (``os._exit``: no clean-up,
  as if the process were killed), while the main thread waits;
- ``exit-ok`` / ``exit-fail``: return at once, the interpreter exiting with the save in
  flight (its writer slowed; with ``exit-fail`` its file write fails with a full disk).

    python tests/faults/async_jax_worker.py PATH MODE
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import time

# 8 CPU devices, as tests/conftest.py gives the test process, before JAX starts.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from gradsync_core.checkpoint import save_hook
from gradsync_jax import load_optimizer_state, save_optimizer_state
from tests.faults.jax_save_worker import DIED, bumped, problem

_HOOKS = contextlib.ExitStack()  # never closed (collecting a hook would remove it)


def _slow_writer(fail: bool) -> None:
    time.sleep(1.0)  # the main thread has returned by now: the interpreter is exiting
    if fail:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def main(path: str, mode: str) -> None:
    tx, params = problem()
    state, manifest = load_optimizer_state(path, tx, params)
    if mode.startswith("die-"):
        _HOOKS.enter_context(save_hook(mode[len("die-") :], lambda: os._exit(DIED)))
    else:
        _HOOKS.enter_context(save_hook("before_file", lambda: _slow_writer(mode == "exit-fail")))
    handle = save_optimizer_state(
        path, tx, bumped(state, 1), params, step=manifest.step + 1, blocking=False
    )
    print("returned", flush=True)
    if mode.startswith("die-"):
        handle.wait()
        sys.exit(f"the save at {mode!r} ended instead of dying there")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
