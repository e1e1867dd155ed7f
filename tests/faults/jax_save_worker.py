"""Run as a script by ``test_jax_save_faults.py``: load the checkpoint at PATH, change every
state leaf, and save it again at the next step, exiting at POINT of that save (``os._exit``:
no clean-up, as if the process were killed).

    python tests/faults/jax_save_worker.py PATH POINT
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

# 8 CPU devices, as tests/conftest.py gives the test process, before JAX starts.
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import jax
import optax

from gradsync_core import Topology
from gradsync_core.checkpoint import save_hook
from gradsync_jax import (
    load_optimizer_state,
    mesh_from_topology,
    save_optimizer_state,
    shard_optimizer,
)

_HOOKS = contextlib.ExitStack()
DEVICES = 4
DIED = 17
# Where the process dies: the save point (gradsync_core.checkpoint.SAVE_POINTS) whose first
# pass it exits at.
KILL_POINTS: dict[str, str] = {
    "before the rank files": "before_file",
    "between rank files": "after_file",  # the first file is written, the others not
    "before the switch": "before_switch",
    "after the switch": "after_switch",
}


def problem() -> tuple[Any, dict[str, Any]]:
    """The ``shard_optimizer`` (Adam, 4 devices) and parameters both processes use."""
    mesh = mesh_from_topology(Topology.create(DEVICES), devices=jax.devices()[:DEVICES])
    params = {
        "dense": {"kernel": jax.numpy.ones((6, 10)), "bias": jax.numpy.zeros((10,))},
        "head": {"kernel": jax.numpy.ones((10, 3)), "bias": jax.numpy.zeros((3,))},
    }
    return shard_optimizer(optax.adam(1e-2), mesh), params


def bumped(state: Any, amount: int) -> Any:
    """``state`` with ``amount`` added to every leaf (moments and count alike)."""
    return jax.tree.map(lambda leaf: leaf + jax.numpy.asarray(amount, leaf.dtype), state)


def _die_at(point: str) -> None:
    # Never closed (and kept referenced, or collecting it would close it): the process exits
    # at the point.
    _HOOKS.enter_context(save_hook(KILL_POINTS[point], lambda: os._exit(DIED)))


def main(path: str, point: str) -> None:
    tx, params = problem()
    state, manifest = load_optimizer_state(path, tx, params)
    _die_at(point)
    save_optimizer_state(path, tx, bumped(state, 1), params, step=manifest.step + 1)
    sys.exit(f"the save at {point!r} returned instead of dying there")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
