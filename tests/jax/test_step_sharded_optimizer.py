"""data_parallel_step with a shard_optimizer: ZeRO state, same training as the reference.

The step hands local gradients to the sharded optimizer (which reduce-scatters them itself)
and carries its state with the optimizer's own partition specs. Compared with the
single-device full-batch reference: parameters and the gathered Adam mu/nu/count, rtol 1e-5
(atol 1e-5 x the leaf's largest magnitude), as in tests/jax/test_step.py.
"""

from __future__ import annotations

import copy

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

from gradsync_jax import data_parallel_step, shard_optimizer, synced
from tests.jax.step_problem import BATCH, MESH, PARAMS, reference_training, run_training
from tests.jax.step_problem import LOSS as LOSS_FN
from tests.support.asserts import assert_tree_close


@pytest.mark.slow
@pytest.mark.parametrize("partition", ["greedy", "flat"])
def test_sharded_optimizer_step_equals_single_device_full_batch(partition: str) -> None:
    inner = optax.adam(1e-2)
    tx = shard_optimizer(inner, MESH, partition=partition)
    params, state, losses = run_training(
        data_parallel_step(LOSS_FN, tx, MESH, accumulate_steps=2), tx, 3
    )
    ref_params, ref_state, ref_losses = reference_training(inner, 3)
    assert_tree_close(params, ref_params)
    assert_tree_close(tx.gather_state(state, params), ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    # The state really is sharded: each device holds less than Adam's full mu + nu (on this
    # tiny model greedy's share is set by its largest tensor, so no tighter bound holds).
    param_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(PARAMS))
    assert tx.state_nbytes_per_device(PARAMS) < 2 * param_bytes


def test_conflicting_options_are_refused() -> None:
    tx = shard_optimizer(optax.adam(1e-2), MESH)
    with pytest.raises(ValueError, match="reduces the local gradients itself"):
        data_parallel_step(LOSS_FN, tx, MESH, param_specs=jax.tree.map(lambda _: P(), PARAMS))
    with pytest.raises(ValueError, match="reduces the local gradients itself"):
        data_parallel_step(LOSS_FN, tx, MESH, axis_name=("dp", "pp"))
    # A synced before shard_optimizer would sync twice; refused before anything runs.
    twice = optax.chain(synced("dp"), tx)
    with pytest.raises(ValueError, match="tx syncs the gradients 2 times"):
        data_parallel_step(LOSS_FN, twice, MESH)(PARAMS, twice.init(PARAMS), BATCH)
    nested = optax.chain(optax.scale(1.0), tx)
    with pytest.raises(ValueError, match="holds a shard_optimizer"):
        data_parallel_step(LOSS_FN, nested, MESH)(PARAMS, nested.init(PARAMS), BATCH)
    # global_norm= is how shard_optimizer hands clip_by_global_norm the norm: reserved.
    with pytest.raises(ValueError, match="global_norm= is the extra argument"):
        step = data_parallel_step(LOSS_FN, tx, MESH, loss_as="global_norm")
        step(PARAMS, tx.init(PARAMS), BATCH)


def test_sharded_optimizer_keeps_its_transform_through_a_copy() -> None:
    tx = shard_optimizer(optax.adam(1e-2), MESH)
    clone = copy.copy(tx)
    assert isinstance(clone, optax.GradientTransformationExtraArgs)
    assert clone.settings is tx.settings and clone.plan(PARAMS) == tx.plan(PARAMS)
