"""The data-parallel step tests' problem: a Flax MLP on 8 devices, its single-device reference."""

from __future__ import annotations

import jax
import optax

from gradsync_core import Topology
from gradsync_jax import mesh_from_topology
from tests.jax.multiprocess_worker import make_loss, make_problem

DP = 8
MODEL, PARAMS, BATCH = make_problem(batch=32)
LOSS = make_loss(MODEL)
MESH = mesh_from_topology(Topology.create(DP))
OPTIMIZERS = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(0.1, momentum=0.9)}


def reference_training(tx, steps: int, params=PARAMS, batch=BATCH):
    """Single device, whole batch, no gradsync."""

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(LOSS)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = tx.init(params), []
    for _ in range(steps):
        params, state, loss = step(params, state)
        losses.append(loss)
    return params, state, losses


def run_training(step, tx, steps: int):
    params, state, losses = PARAMS, tx.init(PARAMS), []
    for _ in range(steps):
        params, state, loss = step(params, state, BATCH)
        losses.append(loss)
    return params, state, losses
