"""The step tests' Flax MLP problem, and the worker of the 2-process jax.distributed test.

As a script: ``python multiprocess_worker.py PROCESS_ID NUM_PROCESSES PORT OUT_DIR``; each
process owns 2 CPU devices, joins ``jax.distributed`` on 127.0.0.1, trains the MLP for
``STEPS`` Adam steps with ``data_parallel_step`` over all 4 devices and writes its
parameters and Adam moments to ``OUT_DIR/process_<id>.npz``.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import numpy as np

from tests.jax.distributed_start import start_process

STEPS = 3
LR = 1e-2


def make_problem(batch: int = 32, seed: int = 0) -> tuple[Any, Any, tuple[Any, Any]]:
    """(model, params, (x, y)): a 3-layer linen MLP with deterministic data."""
    import flax.linen as nn
    import jax
    import jax.numpy as jnp

    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            x = nn.tanh(nn.Dense(24)(x))
            x = nn.tanh(nn.Dense(24)(x))
            return nn.Dense(4)(x)

    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(batch, 10)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(batch, 4)), jnp.float32)
    model = MLP()
    params = model.init(jax.random.key(seed), x[:1])
    return model, params, (x, y)


def make_loss(model: Any) -> Any:
    import jax.numpy as jnp

    def loss_fn(params: Any, batch: tuple[Any, Any]) -> Any:
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss_fn


def main(process_id: int, num_processes: int, port: int, out_dir: str) -> None:
    start_process(process_id, num_processes, port)
    import jax
    import optax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradsync_core import Topology
    from gradsync_jax import data_parallel_step, mesh_from_topology

    assert jax.device_count() == 2 * num_processes, jax.devices()
    mesh = mesh_from_topology(Topology.create(jax.device_count()))
    model, params, batch = make_problem()
    loss_fn = make_loss(model)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))

    def global_array(value: Any, sharding: NamedSharding) -> jax.Array:
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    tx = optax.adam(LR)
    params = jax.tree.map(lambda v: global_array(v, replicated), params)
    batch = jax.tree.map(lambda v: global_array(v, sharded), batch)
    opt_state = jax.jit(tx.init, out_shardings=replicated)(params)
    step = data_parallel_step(loss_fn, tx, mesh)
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss = step(params, opt_state, batch)
        losses.append(float(loss.addressable_data(0)))

    def local(tree: Any) -> list[np.ndarray]:
        return [np.asarray(leaf.addressable_data(0)) for leaf in jax.tree.leaves(tree)]

    adam = opt_state[0]
    arrays = {f"params_{i}": a for i, a in enumerate(local(params))}
    arrays |= {f"mu_{i}": a for i, a in enumerate(local(adam.mu))}
    arrays |= {f"nu_{i}": a for i, a in enumerate(local(adam.nu))}
    arrays["count"] = np.asarray(adam.count.addressable_data(0))
    arrays["losses"] = np.asarray(losses)
    arrays["device_ids"] = np.asarray([d.id for d in mesh.devices.flat])
    np.savez(os.path.join(out_dir, f"process_{process_id}.npz"), **arrays)
    jax.distributed.shutdown()


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
