"""Worker of the 2-process checkpoint test: ``python checkpoint_multiprocess_worker.py
PROCESS_ID NUM_PROCESSES PORT OUT_DIR``.

Each process owns 2 CPU devices of a 4-device ``jax.distributed`` mesh on 127.0.0.1. The
processes train the test_zero_checkpoint problem for 3 steps (greedy ``shard_optimizer``),
then together:

- save it with its weights to ``OUT_DIR/greedy`` and load it back with the flat partition
  (another owner layout, same 2 x 2 devices), which must be bitwise the state in memory;
- save that flat state to ``OUT_DIR/flat``;
- save again to ``OUT_DIR/greedy`` with process 1's file writes failing: both processes
  must raise, and ``OUT_DIR/greedy`` must still be the first save.

Then ZeRO-3 (``zero3_step``, zero3_problem.py's model) trains 2 steps, is saved to
``OUT_DIR/zero3`` with ``save_param_shards`` (each process writes its devices' rows) and
loaded back on 2 x 2 with ``load_param_shards``, which must be bitwise the state in memory;
the same for HSDP on a 2 x 2 ``("replicate", "shard")`` mesh, one replica per process
(``OUT_DIR/hsdp``: each shard rank's file written once, by the process of its first device).

Process 0 writes the gathered in-memory state, parameters and what each step saw to
``OUT_DIR/result.npz``; the test loads the checkpoints on 1 x 4 and 1 x 8 devices.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from tests.jax.distributed_start import start_process

STEPS = 3


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    start_process(process_id, num_processes, port)
    import jax
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradsync_core import CheckpointError, Topology, read_manifest
    from gradsync_core.checkpoint import save_hook
    from gradsync_jax import (
        load_optimizer_state,
        make_local,
        mesh_from_topology,
        save_optimizer_state,
        shard_optimizer,
    )
    from gradsync_jax.checkpoint.processes import place
    from tests.jax.zero_checkpoint_problem import batch, inner, loss_fn, params0

    mesh = mesh_from_topology(Topology.create(jax.device_count()))
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    tx = shard_optimizer(inner(), mesh, partition="greedy")
    params = place(params0(), jax.tree.map(lambda _: replicated, params0()))
    state = jax.jit(tx.init, out_shardings=tx.state_shardings(params))(params)
    specs = tx.state_specs(params)

    def body(p: Any, s: Any, x: Any, y: Any) -> Any:
        grads = jax.grad(loss_fn)(make_local(p), x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs)
        )
    )
    for i in range(STEPS):
        x, y = (place(v, sharded) for v in batch(i))
        params, state = step(params, state, x, y)

    def gathered(opt: Any, s: Any) -> list[np.ndarray]:
        full = multihost_utils.process_allgather(s, tiled=True)
        return [np.asarray(v) for v in jax.tree.leaves(opt.gather_state(full, params))]

    expected = gathered(tx, state)
    greedy_dir, flat_dir = os.path.join(out_dir, "greedy"), os.path.join(out_dir, "flat")
    save_optimizer_state(greedy_dir, tx, state, params, step=STEPS, model=params)

    tx_flat = shard_optimizer(inner(), mesh, partition="flat")
    loaded, manifest = load_optimizer_state(greedy_dir, tx_flat, params)
    reloaded = gathered(tx_flat, loaded)
    same = all(np.array_equal(a, b) for a, b in zip(expected, reloaded, strict=True))
    save_optimizer_state(flat_dir, tx_flat, loaded, params, step=STEPS)

    first_manifest = read_manifest(greedy_dir)

    def refuse() -> None:  # this process's rank files cannot be written
        if process_id == 1:
            raise OSError("no space left on device")

    try:
        with save_hook("before_file", refuse):
            save_optimizer_state(greedy_dir, tx, state, params, step=STEPS + 1)
        failure = "none"
    except CheckpointError as err:  # the same type on every process; the cause where it failed
        cause = type(err.__cause__).__name__ if err.__cause__ is not None else "None"
        failure = f"CheckpointError (cause {cause}): {err}"
    multihost_utils.sync_global_devices("failed save done")
    kept = read_manifest(greedy_dir) == first_manifest
    leftovers = sorted(n for n in os.listdir(out_dir) if ".tmp-" in n)

    with open(os.path.join(out_dir, f"failure_{process_id}.txt"), "w") as f:
        f.write(failure)
    flags = multihost_utils.process_allgather(
        np.asarray([same, kept, not leftovers, failure != "none"], np.bool_)
    )
    zero3 = _zero3(mesh, os.path.join(out_dir, "zero3"))
    # HSDP with one replica per process (the usual hybrid mesh: shard within a host,
    # replicate across hosts): both processes hold shard ranks 0 and 1, one writes each file.
    hybrid = Mesh(np.array(jax.devices()).reshape(2, 2), ("replicate", "shard"))
    zero3 |= _zero3(hybrid, os.path.join(out_dir, "hsdp"), prefix="hsdp")
    if process_id == 0:
        arrays = {f"state_{i}": v for i, v in enumerate(expected)}
        arrays |= zero3
        host_params = jax.tree.leaves(
            jax.tree.map(lambda a: np.asarray(a.addressable_data(0)), params)
        )
        arrays |= {f"params_{i}": v for i, v in enumerate(host_params)}
        arrays["flags"] = np.asarray(flags)
        arrays["loaded_world_size"] = np.asarray(manifest.world_size)
        np.savez(os.path.join(out_dir, "result.npz"), **arrays)
    multihost_utils.sync_global_devices("results written")
    jax.distributed.shutdown()


ZERO3_STEPS = 2


def _zero3(mesh: Any, directory: str, prefix: str = "zero3") -> dict[str, np.ndarray]:
    """Train, save and load a ZeRO-3 state on every process; its whole parameters and state
    (``<prefix>_*``) and whether the load was bitwise the state in memory (``<prefix>_same``).
    On a ``("replicate", "shard")`` mesh it is HSDP: cut over ``shard``, replicated over
    ``replicate``."""
    import jax
    from jax.experimental import multihost_utils
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradsync_jax import param_layout, shard_params, zero3_step
    from gradsync_jax.checkpoint.param_shards import load_param_shards, save_param_shards
    from gradsync_jax.checkpoint.processes import local_ranks, place
    from tests.jax import zero3_problem as model

    hybrid = "replicate" in mesh.axis_names
    axis, replicate = ("shard", "replicate") if hybrid else ("dp", None)
    layout = param_layout(
        model.init_params(),
        world_size=mesh.size,
        units=model.UNITS,
        frozen=["frozen"],
        dp_shard=mesh.shape["shard"] if hybrid else None,
    )
    step = zero3_step(
        model.loss_fn, model.adamw(), mesh, layout, axis_name=axis, replicate_axis_name=replicate
    )
    params = shard_params(model.init_params(), mesh, layout, axis_name=axis)
    state = step.init(params)
    batch = place(model.data(), (NamedSharding(mesh, P(mesh.axis_names)),) * 2)
    for _ in range(ZERO3_STEPS):
        params, state, _ = step(params, state, batch)
    save_param_shards(directory, step, params, state, step=ZERO3_STEPS)
    loaded = load_param_shards(directory, step)[:2]
    gather = lambda tree: [  # noqa: E731
        np.asarray(v) for v in jax.tree.leaves(multihost_utils.process_allgather(tree, tiled=True))
    ]
    whole, back = gather((params, state)), gather(tuple(loaded))
    same = all(np.array_equal(a, b) for a, b in zip(whole, back, strict=True))
    # Which process writes which rank file: one row per process, one column per rank.
    mine = local_ranks(mesh, step.axes)
    writers = multihost_utils.process_allgather(np.isin(np.arange(layout.world_size), list(mine)))
    out = {f"{prefix}_{i}": v for i, v in enumerate(whole)}
    return out | {f"{prefix}_same": np.asarray(same), f"{prefix}_writers": np.asarray(writers)}


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
