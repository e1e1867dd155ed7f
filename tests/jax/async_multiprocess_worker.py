"""Worker of ``test_async_multiprocess.py``: ``python async_multiprocess_worker.py PROCESS_ID
NUM_PROCESSES PORT OUT_DIR``.

Each process owns 2 CPU devices of a 4-device ``jax.distributed`` mesh on 127.0.0.1 and trains
the test_zero_checkpoint problem (greedy ``shard_optimizer``). Then, together:

- ``OUT_DIR/async``: a save with ``blocking=False``, its writers held until both processes
  trained 2 more steps (and ran those steps' collectives while the writers agreed through the
  key-value store); process 0 writes the state at the call to ``OUT_DIR/async.npz``;
- ``OUT_DIR/async``, again: process 1's file write fails with a full disk; each process writes
  what its ``wait()`` raised to ``OUT_DIR/failure_<process>.txt``; then a third save
  (``OUT_DIR/last``), after which the key-value store must hold that save's keys only
  (``OUT_DIR/keys_<process>.txt``);
- preemption: both print ``training`` and train under a ``PreemptionHandler`` until the test
  sends SIGTERM; both must save at the same step (``OUT_DIR/preempted``, with
  ``blocking=False``; process 0 writes the state to ``OUT_DIR/preempted.npz``) and exit 143.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import threading
from typing import Any

import numpy as np

from tests.jax.distributed_start import start_process


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    start_process(process_id, num_processes, port)
    import jax
    import optax
    from jax._src import distributed
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradsync_core import CheckpointError, Topology
    from gradsync_core.checkpoint import save_hook
    from gradsync_jax import (
        PreemptionHandler,
        make_local,
        mesh_from_topology,
        save_optimizer_state,
        shard_optimizer,
    )
    from gradsync_jax.checkpoint.processes import place
    from tests.jax.zero_checkpoint_problem import batch, loss_fn, params0

    mesh = mesh_from_topology(Topology.create(jax.device_count()))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    tx = shard_optimizer(optax.adam(1e-2), mesh, partition="greedy")
    params = place(params0(), jax.tree.map(lambda _: replicated, params0()))
    state = jax.jit(tx.init, out_shardings=tx.state_shardings(params))(params)
    specs = tx.state_specs(params)

    def body(p: Any, s: Any, x: Any, y: Any) -> Any:
        grads = jax.grad(loss_fn)(make_local(p), x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    train = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs)
        ),
        donate_argnums=(0, 1),
    )

    def step(i: int) -> None:
        nonlocal params, state
        x, y = (place(v, sharded) for v in batch(i))
        params, state = train(params, state, x, y)

    def gathered() -> dict[str, np.ndarray]:
        full = multihost_utils.process_allgather(state, tiled=True)
        host = jax.tree.map(np.asarray, multihost_utils.process_allgather(params, tiled=True))
        leaves = jax.tree.leaves(tx.gather_state(full, host))
        return {f"state_{i}": np.asarray(v) for i, v in enumerate(leaves)}

    for i in range(3):
        step(i)
    path = os.path.join(out_dir, "async")
    at_call = gathered()
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(30)):
        handle = save_optimizer_state(path, tx, state, params, step=3, blocking=False)
        for i in range(3, 5):
            step(i)
        release.set()
        handle.wait(timeout=120)
    if process_id == 0:
        np.savez(f"{path}.npz", **at_call)

    def full_disk() -> None:
        if process_id == 1:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with save_hook("before_file", full_disk):
        handle = save_optimizer_state(path, tx, state, params, step=5, blocking=False)
        step(5)
        try:
            handle.wait(timeout=120)
            failure = "none"
        except CheckpointError as err:
            cause = type(err.__cause__).__name__ if err.__cause__ is not None else "None"
            failure = f"CheckpointError (cause {cause}): {err}"
    with open(os.path.join(out_dir, f"failure_{process_id}.txt"), "w") as f:
        f.write(failure)
    last = os.path.join(out_dir, "last")
    save_optimizer_state(last, tx, state, params, step=6, blocking=False).wait(timeout=120)
    client = distributed.global_state.client
    keys = sorted(k for k, _ in client.key_value_dir_get("gradsync/background_save/"))
    with open(os.path.join(out_dir, f"keys_{process_id}.txt"), "w") as f:
        json.dump(keys, f)
    multihost_utils.sync_global_devices("saves done")

    preempted = os.path.join(out_dir, "preempted")
    with PreemptionHandler() as preemption:
        for i in range(6, 100_000):
            step(i)
            if i == 8:
                print("training", flush=True)
            if preemption.should_save(i):
                print(f"saving at step {i}", flush=True)
                at_save = gathered()
                if process_id == 0:
                    np.savez(f"{preempted}.npz", **at_save)
                save_optimizer_state(preempted, tx, state, params, step=i, blocking=False)
                preemption.exit()
    sys.exit("never preempted")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
