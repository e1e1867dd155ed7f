"""Traps a new user falls into loading weights on the JAX side (issue 22 item 4): an NNX model
with frozen (non-Param) variables, and a checkpoint in another floating dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from gradsync_core import Topology
from gradsync_jax import load_params, mesh_from_topology, save_optimizer_state, shard_optimizer


class Frozen(nnx.Variable):
    """A weight that is not trained: outside nnx.Param, as a frozen torch parameter."""


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=jnp.float32) -> None:
        self.pos = Frozen(jax.random.normal(jax.random.key(1), (4, 3)).astype(dtype))
        self.fc = nnx.Linear(3, 2, rngs=rngs, param_dtype=dtype)


def leaves(model: nnx.Module) -> list:
    return jax.tree.leaves(nnx.state(model))


def saved(tmp_path, dtype=jnp.float32):
    """A checkpoint of ``Block``'s weights, the frozen one included (as torch stores it)."""
    model = Block(nnx.Rngs(0), dtype)
    weights = nnx.as_pure(nnx.state(model, nnx.Any(nnx.Param, Frozen)))
    params = nnx.as_pure(nnx.state(model, nnx.Param))
    mesh = mesh_from_topology(Topology.create(2), jax.devices()[:2])
    tx = shard_optimizer(optax.sgd(0.1), mesh)
    path = str(tmp_path / "ckpt")
    save_optimizer_state(path, tx, tx.init(params), params, step=0, model=weights)
    return path, model


def test_frozen_variables_need_their_type_in_the_filter_and_the_error_says_so(tmp_path):
    path, model = saved(tmp_path)
    fresh = Block(nnx.Rngs(7))
    with pytest.raises(ValueError, match=r"has 'pos'.*nnx\.Any\(nnx\.Param, Frozen\)") as e:
        load_params(path, nnx.state(fresh, nnx.Param))
    assert "modules= renames" not in str(e.value)
    nnx.update(fresh, load_params(path, nnx.state(fresh, nnx.Any(nnx.Param, Frozen))))
    for got, want in zip(leaves(fresh), leaves(model), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    "saved_dtype, model_dtype", [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16)]
)
def test_another_floating_dtype_loads_when_cast_is_asked(tmp_path, saved_dtype, model_dtype):
    path, model = saved(tmp_path, saved_dtype)
    fresh = Block(nnx.Rngs(7), model_dtype)
    like = nnx.state(fresh, nnx.Any(nnx.Param, Frozen))
    with pytest.raises(
        ValueError, match="only the dtype differs; pass allow_dtype_conversion=True"
    ):
        load_params(path, like)
    nnx.update(fresh, load_params(path, like, allow_dtype_conversion=True))
    for got, want in zip(leaves(fresh), leaves(model), strict=True):
        assert got.dtype == model_dtype
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want.astype(model_dtype)))
