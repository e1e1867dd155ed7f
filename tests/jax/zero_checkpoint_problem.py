"""The ZeRO-1 checkpoint tests' problem (test_zero_checkpoint.py, the multi-process and the
swapped-files tests): a two-layer regression trained for real (``jax.grad`` of local losses
w.r.t. ``make_local(params)``) under a ``shard_optimizer``, and its unsharded reference.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_jax import make_local
from tests.support.models import random_params

BATCH = 32
SHAPES = {"dense_0": {"kernel": (6, 10), "bias": (10,)}, "head": {"kernel": (10, 3), "bias": (3,)}}


def inner() -> optax.GradientTransformation:
    return optax.inject_hyperparams(optax.adamw)(learning_rate=1e-2, weight_decay=0.05)


def params0() -> dict:
    return random_params(SHAPES)


def batch(step: int) -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(100 + step)
    x = rng.normal(size=(BATCH, 6)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(np.sin(x[:, :3]) + 0.1 * x[:, 3:])


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["dense_0"]["kernel"] + params["dense_0"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)


def train(tx, params, state, steps: range):
    mesh, specs = tx.mesh, tx.state_specs(params)

    def body(p, s, x, y):
        grads = jax.grad(loss_fn)(make_local(p), x, y)  # local: gradsync reduces them
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    step = jax.jit(
        jax.shard_map(
            body, mesh=mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs)
        )
    )
    params = jax.device_put(params, NamedSharding(mesh, P()))
    data = NamedSharding(mesh, P("dp"))
    for i in steps:
        params, state = step(params, state, *jax.device_put(batch(i), data))
    return params, state


def reference(steps: int):
    tx = inner()
    params, state = params0(), tx.init(params0())
    for i in range(steps):
        updates, state = tx.update(jax.grad(loss_fn)(params, *batch(i)), state, params)
        params = optax.apply_updates(params, updates)
    return params, state
