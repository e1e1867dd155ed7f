"""The JAX side of ``async_save.py``: 8 CPU devices train, and each save method saves the same
state in turn while the training goes on (the variants alternating, the order rotating).

Run by ``async_save.py`` in a process of its own (JAX's 8 devices are set before it is
imported; torch is never imported here). Reads its arguments as one JSON object on the command
line and prints its figures as one JSON line.

The training: ``shard_optimizer(optax.adam)`` (greedy, ZeRO-1) on the MLP of
``benchmarks/jax_dp.py`` (the torch side's shapes), one jitted ``shard_map`` step that donates
the parameters and the state. The state saved is the parameters plus the Adam state:

    gradsync, blocking          save_optimizer_state(path, tx, state, params, model=params)
    gradsync, blocking=False    the same with blocking=False
    Orbax save                  orbax.checkpoint.Checkpointer(StandardCheckpointHandler()) of
                                {"params": params, "opt_state": state}
    Orbax async                 orbax.checkpoint.AsyncCheckpointer(StandardCheckpointHandler())

A save's blocked time is its call; then a fixed number of steps, each marked in flight when the
save had not ended as it started (Orbax: its background thread is alive), then the wait.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import numpy as np
import optax
import orbax.checkpoint as ocp
from absl import logging as absl_logging
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from jax_dp import loss_fn, make_mlp

from gradsync_core import Topology
from gradsync_jax import (
    mesh_from_topology,
    save_optimizer_state,
    shard_optimizer,
    value_and_local_grad,
)

SYNC = "gradsync, blocking"
ASYNC = "gradsync, blocking=False"
ORBAX_SYNC = "Orbax save"
ORBAX_ASYNC = "Orbax async"
VARIANTS = (SYNC, ASYNC, ORBAX_SYNC, ORBAX_ASYNC)


def _train_step(tx: Any, params: Any) -> Any:
    specs = tx.state_specs(params)

    def local(p: Any, s: Any, batch: Any) -> Any:
        _, grads = value_and_local_grad(loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    mapped = jax.shard_map(
        local, mesh=tx.mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs)
    )
    return jax.jit(mapped, donate_argnums=(0, 1))


class _Ended:
    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _Orbax:
    """Orbax's async save as a handle: in flight while its background thread lives."""

    def __init__(self, checkpointer: Any) -> None:
        self.checkpointer = checkpointer

    def done(self) -> bool:
        thread = self.checkpointer._async_manager._thread  # no public "is it done?"
        return thread is None or not thread.is_alive()

    def wait(self) -> None:
        self.checkpointer.wait_until_finished()


def main(options: dict[str, Any]) -> dict[str, Any]:
    absl_logging.set_verbosity(absl_logging.WARNING)
    root = options["dir"]
    mesh = mesh_from_topology(Topology.create(len(jax.devices())))
    tx = shard_optimizer(optax.adam(1e-4), mesh, partition="greedy")
    params = jax.device_put(make_mlp(options["layers"], options["width"]), NamedSharding(mesh, P()))
    state = tx.init(params)
    step_fn = _train_step(tx, params)
    rng = np.random.default_rng(1)
    batch = jax.device_put(
        (
            rng.normal(size=(options["batch"], options["width"])).astype(np.float32),
            rng.normal(size=(options["batch"], options["width"])).astype(np.float32),
        ),
        NamedSharding(mesh, P("dp")),
    )
    held = {"params": params, "state": state}

    def step() -> float:
        start = time.perf_counter()
        held["params"], held["state"] = step_fn(held["params"], held["state"], batch)
        jax.block_until_ready(held["params"])
        return time.perf_counter() - start

    orbax_sync = ocp.Checkpointer(ocp.StandardCheckpointHandler())
    orbax_async = ocp.AsyncCheckpointer(ocp.StandardCheckpointHandler())
    saves = 0

    def start(name: str) -> Any:
        nonlocal saves
        saves += 1
        path = os.path.join(root, f"{VARIANTS.index(name)}-{saves}")
        p, s = held["params"], held["state"]
        if name == SYNC:
            save_optimizer_state(path, tx, s, p, step=saves, model=p)
            return _Ended()
        if name == ASYNC:
            return save_optimizer_state(path, tx, s, p, step=saves, model=p, blocking=False)
        tree = {"params": p, "opt_state": s}
        if name == ORBAX_SYNC:
            orbax_sync.save(path, args=ocp.args.StandardSave(tree))
            return _Ended()
        orbax_async.save(path, args=ocp.args.StandardSave(tree))
        return _Orbax(orbax_async)

    step()
    numel = sum(leaf.size for leaf in jax.tree.leaves(held["params"]))
    state_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves((held["params"], held["state"])))
    q, d = options["quiet_steps"], options["during_steps"]
    rows: dict[str, list[tuple[float, list[float], list[float], list[bool]]]] = {
        name: [] for name in VARIANTS
    }
    for r in range(options["warmup"] + options["rounds"]):
        order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
        for name in order:
            quiet = [step() for _ in range(q)]
            begin = time.perf_counter()
            handle = start(name)
            blocked = time.perf_counter() - begin
            during, flags = [], []
            for _ in range(d):
                flags.append(not handle.done())
                during.append(step())
            handle.wait()
            shutil.rmtree(root, ignore_errors=True)  # not timed: every save has ended
            os.makedirs(root, exist_ok=True)
            if r >= options["warmup"]:
                rows[name].append((blocked, quiet, during, flags))
    quiet_step = statistics.median(s for name in VARIANTS for row in rows[name] for s in row[1])
    out: dict[str, Any] = {
        "params": int(numel),
        "state_bytes": int(state_bytes),
        "quiet_step_s": quiet_step,
        "variants": {},
    }
    for name in VARIANTS:
        in_flight = [s for row in rows[name] for s, f in zip(row[2], row[3], strict=True) if f]
        out["variants"][name] = {
            "blocked_s": statistics.median(row[0] for row in rows[name]),
            "steps_in_flight": len(in_flight),
            "step_in_flight_s": statistics.median(in_flight) if in_flight else None,
            "slowdown": statistics.median(in_flight) / quiet_step if in_flight else 1.0,
        }
    return out


if __name__ == "__main__":
    print(json.dumps(main(json.loads(sys.argv[1]))), flush=True)
