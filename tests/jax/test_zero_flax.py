"""Flax code does not change: ``nnx.Optimizer`` and linen's ``TrainState.apply_gradients``
take ``shard_optimizer`` as they take any Optax transformation, and train exactly like the
unsharded optimizer (parameters and Adam moments within 1e-5 relative, 4 devices)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen, nnx
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology
from gradsync_jax import make_local, mesh_from_topology, shard_optimizer
from tests.support.asserts import assert_tree_close

pytestmark = pytest.mark.slow

N, STEPS = 4, 3
X = jnp.asarray(np.random.default_rng(0).normal(size=(8 * N, 5)), jnp.float32)
Y = jnp.sin(X[:, :2])
MESH = mesh_from_topology(Topology.create(N), devices=jax.devices()[:N])


def place(tree):
    """Everything replicated on the mesh except what is already sharded on it."""

    def sharding(x):
        s = getattr(x, "sharding", None)
        return s if isinstance(s, NamedSharding) and s.mesh == MESH else NamedSharding(MESH, P())

    return jax.device_put(tree, jax.tree.map(sharding, tree))


def specs_of(tree):
    return jax.tree.map(lambda x: x.sharding.spec, tree)


class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.hidden = nnx.Linear(5, 8, rngs=rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(jnp.tanh(self.hidden(x)))


def nnx_loss(model: Net, x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((model(x) - y) ** 2)


def test_nnx_optimizer() -> None:
    model = Net(nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, shard_optimizer(optax.adam(1e-2), MESH), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    state = place(state)
    specs = specs_of(state)

    def body(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        model_def, params, rest = nnx.split(model, nnx.Param, ...)
        grads = jax.grad(lambda p: nnx_loss(nnx.merge(model_def, p, rest), x, y))(
            make_local(params)
        )
        optimizer.update(model, grads)  # unchanged Flax call
        return nnx.state((model, optimizer))

    step = jax.jit(
        jax.shard_map(body, mesh=MESH, in_specs=(specs, P("dp"), P("dp")), out_specs=specs)
    )
    data = NamedSharding(MESH, P("dp"))
    for _ in range(STEPS):
        state = step(state, jax.device_put(X, data), jax.device_put(Y, data))

    ref_model = Net(nnx.Rngs(0))
    ref_opt = nnx.Optimizer(ref_model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def ref_step(model, optimizer):
        optimizer.update(model, nnx.grad(nnx_loss)(model, X, Y))

    for _ in range(STEPS):
        ref_step(ref_model, ref_opt)
    model, optimizer = nnx.merge(graphdef, state)
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    assert_tree_close(params, nnx.as_pure(nnx.state(ref_model, nnx.Param)), atol_rel=1e-6)
    moments = optimizer.tx.gather_state(nnx.as_pure(optimizer.opt_state), params)
    assert_tree_close(moments, nnx.as_pure(ref_opt.opt_state), atol_rel=1e-6)
    assert int(optimizer.step[...]) == STEPS


class LinenNet(linen.Module):
    @linen.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        return linen.Dense(2)(jnp.tanh(linen.Dense(8)(x)))


def test_linen_train_state() -> None:
    net = LinenNet()
    params = net.init(jax.random.key(0), X[:1])["params"]
    tx = shard_optimizer(optax.adamw(1e-2, weight_decay=0.1), MESH, partition="flat")
    state = place(TrainState.create(apply_fn=net.apply, params=params, tx=tx))
    specs = specs_of(state)

    def loss(p, x, y):
        return jnp.mean((net.apply({"params": p}, x) - y) ** 2)

    def body(state, x, y):
        grads = jax.grad(loss)(make_local(state.params), x, y)
        return state.apply_gradients(grads=grads)  # unchanged Flax call

    step = jax.jit(
        jax.shard_map(body, mesh=MESH, in_specs=(specs, P("dp"), P("dp")), out_specs=specs)
    )
    data = NamedSharding(MESH, P("dp"))
    for _ in range(STEPS):
        state = step(state, jax.device_put(X, data), jax.device_put(Y, data))

    ref = TrainState.create(
        apply_fn=net.apply, params=params, tx=optax.adamw(1e-2, weight_decay=0.1)
    )
    for _ in range(STEPS):
        ref = ref.apply_gradients(grads=jax.grad(loss)(ref.params, X, Y))
    assert_tree_close(state.params, ref.params, atol_rel=1e-6)
    assert_tree_close(tx.gather_state(state.opt_state, params), ref.opt_state, atol_rel=1e-6)
    assert int(state.step) == STEPS
