"""optax.contrib.muon under zero3_step: each matrix whole on its planned owner, exactly.

The parameters are the GPT tree of ``muon_problem`` (Muon on the hidden layers' matrices,
its AdamW on the embeddings, norms, biases and the output layer), cut into dim-0 rows over
the devices as ``zero3_step`` cuts them. 5 steps of the step's own update on the mean of the
devices' gradients, reduce-scattered to the rows: the parameters and the whole optimizer
state (model space, the checkpoint's view) equal the unsharded ``optax.contrib.muon`` fed
the same mean gradient, within test_zero_muon.py's tolerance. The owners are the core's
plan, the one ``shard_optimizer`` uses; the all-to-alls move what the plan predicts.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import PartitionSpec as P

from gradsync_jax import (
    load_param_shards,
    param_layout,
    save_param_shards,
    shard_optimizer,
    shard_params,
    unshard_params,
    zero3_step,
)
from gradsync_jax.checkpoint.param_shards import _RowShards
from gradsync_jax.param_sharding.matrices import MatrixRowsUpdate
from tests.jax.muon_problem import HIDDEN, LAYERS, gpt_params, gpt_shapes, muon
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import mean_in_device_order

STEPS = 5


def _no_loss(params, batch):  # the optimizer alone is run here (run_sharded)
    return 0.0


def local_grads(n: int, step: int) -> dict:
    rng = np.random.default_rng(2000 + 37 * n + step)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 1, (n, *s)), jnp.float32),
        gpt_shapes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def run_sharded(step, n: int, params: dict, steps: int = STEPS, start=None):
    """``steps`` steps of ``step``'s update on each device's rows of the mean gradient."""
    mesh, layout, update = step.mesh, step.layout, step.rows_update

    def body(p, s, g):
        u, s = update(g, s, p, ("dp",))
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp"), step.state_specs, P("dp")),
            out_specs=(P("dp"), step.state_specs),
        )
    )
    sharded, state = start or (shard_params(params, mesh, layout), None)
    state = step.init(sharded) if state is None else state
    for k in range(steps):
        grads = shard_params(mean_in_device_order(local_grads(n, k), n), mesh, layout)
        sharded, state = run(sharded, state, grads)
    return sharded, state


def run_reference(n: int, params: dict, steps: int = STEPS):
    tx = muon()
    update = jax.jit(tx.update)
    state = tx.init(params)
    for k in range(steps):
        updates, state = update(mean_in_device_order(local_grads(n, k), n), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def model_space_state(step, state) -> list[np.ndarray]:
    """The state's leaves whole, in the tree's layout (what a checkpoint stores)."""
    return _RowShards(step).gather(jax.tree.map(np.asarray, state))


def check_exact(n: int) -> None:
    params = gpt_params()
    step = zero3_step(_no_loss, muon(), mesh_of(n), param_layout(params, world_size=n))
    update = step.rows_update
    assert isinstance(update, MatrixRowsUpdate)
    # The owners are the core's plan of the torch names: shard_optimizer's.
    assert update.plan == shard_optimizer(muon(), mesh_of(n)).matrix_plan(params)
    assert len(update.plan.matrices) == 4 * LAYERS
    assert {m.name.split(".")[1] for m in update.plan.matrices} == set(HIDDEN)
    sharded, state = run_sharded(step, n, params)
    ref_params, ref_state = run_reference(n, params)
    got = unshard_params(sharded, step.layout)
    assert_tree_close(got, ref_params, atol_rel=1e-6, check_dtype=True, what="parameters")
    assert_tree_close(
        model_space_state(step, state),
        [np.asarray(x) for x in jax.tree.leaves(ref_state)],
        atol_rel=1e-6,
        what="state",
    )
    moved = max(
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3  # the optimizer really moved the parameters


@pytest.mark.slow  # 15 s on the 2-core machine: 8 owners' branches compiled
def test_muon_under_zero3_on_8_devices_equals_unsharded() -> None:
    check_exact(8)


def test_muon_under_zero3_on_4_devices_equals_unsharded() -> None:
    check_exact(4)


def test_exchange_is_the_plans() -> None:
    """Each device sends and receives exactly the rows the plan predicts (gradient, Muon's
    momentum and the parameter in, the update and the momentum back), in two all-to-alls
    per dtype whose buffers are as long as the busiest owner's."""
    n, params = 8, gpt_params()
    step = zero3_step(_no_loss, muon(), mesh_of(n), param_layout(params, world_size=n))
    update = step.rows_update
    assert not update.with_params  # read only with a weight decay (its jaxpr says so)
    for rank in range(n):
        assert update.exchanged(rank) == update.plan.rows_exchange(
            rank, with_params=False, state_leaves=1
        )
    total = update.plan.rows_exchange(0, with_params=False, state_leaves=1)
    assert total.sent_numel > 0
    sharded = shard_params(params, step.mesh, step.layout)
    state = step.init(sharded)
    grads = shard_params(jax.tree.map(jnp.zeros_like, params), step.mesh, step.layout)
    text = (
        jax.jit(
            jax.shard_map(
                lambda g, s, p: update(g, s, p, ("dp",)),
                mesh=step.mesh,
                in_specs=(P("dp"), step.state_specs, P("dp")),
                out_specs=(P("dp"), step.state_specs),
            )
        )
        .lower(grads, state, sharded)
        .as_text()
    )
    (length,) = update.gather_buffers.length.values()
    (back,) = update.scatter_buffers.length.values()
    assert text.count("stablehlo.all_to_all") == 2
    assert f"tensor<{n}x{length}xf32>" in text and f"tensor<{n}x{back}xf32>" in text


class _MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = jnp.tanh(nn.Dense(11, name="fc_in")(x))  # 11 rows: padding at 4 devices
        return nn.Dense(3, name="fc_out")(x)


@pytest.mark.slow  # 15 s: the whole step compiled
def test_zero3_step_trains_muon_as_one_device() -> None:
    """The whole step (gather, backward, reduce-scatter, owners) on a linen MLP at 4 devices:
    Muon on both kernels (transposed to torch's rows and back), AdamW on the biases, 3 steps
    equal one device on the whole batch within the zero3 floor (tests/jax/test_param_sharding)."""
    model, n = _MLP(), 4
    x = np.random.default_rng(0).normal(size=(16, 7)).astype(np.float32)
    y = np.random.default_rng(1).normal(size=(16, 3)).astype(np.float32)
    params = model.init(jax.random.key(0), x)

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)

    tx = optax.contrib.muon(0.02, adam_learning_rate=1e-2)
    layout = param_layout(params, world_size=n, units=["fc_in", "fc_out"])
    step = zero3_step(loss_fn, tx, mesh_of(n), layout)
    assert isinstance(step.rows_update, MatrixRowsUpdate)
    sharded = shard_params(params, mesh_of(n), layout)
    state = step.init(sharded)
    ref_params, ref_state = params, tx.init(params)
    for _ in range(3):
        sharded, state, _ = step(sharded, state, (x, y))
        grads = jax.grad(loss_fn)(ref_params, (x, y))
        updates, ref_state = tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    got = unshard_params(sharded, layout)
    assert_tree_close(got, ref_params, rtol=1e-5, atol_rel=1e-5, what="parameters")
    assert_tree_close(
        model_space_state(step, state),
        [np.asarray(v) for v in jax.tree.leaves(ref_state)],
        rtol=5e-5,
        atol_rel=5e-5,
        what="state",
    )


def test_refuses_a_global_norm_chained_with_muon() -> None:
    """A global-norm clip before Muon reads every parameter; with the matrices on their
    owners nothing completes that sum: refused, one sentence."""
    params = gpt_params()
    tx = optax.chain(optax.clip_by_global_norm(1.0), muon())
    with pytest.raises(ValueError, match=r"reads parameter .* nothing completes") as err:
        zero3_step(_no_loss, tx, mesh_of(4), param_layout(params, world_size=4))
    assert "\n" not in str(err.value)


@pytest.mark.slow  # 36 s: two device counts compiled
def test_checkpoint_continues_at_another_device_count(tmp_path) -> None:
    """Saved from 8 devices after 3 steps, loaded on 4 (other owners, other rows): the state
    comes back bit for bit, and 2 more steps there equal the unsharded 5."""
    params = gpt_params()
    step8 = zero3_step(_no_loss, muon(), mesh_of(8), param_layout(params, world_size=8))
    sharded, state = run_sharded(step8, 8, params, steps=3)
    save_param_shards(tmp_path / "ckpt", step8, sharded, state, step=3)
    step4 = zero3_step(_no_loss, muon(), mesh_of(4), param_layout(params, world_size=4))
    assert step4.rows_update.plan != step8.rows_update.plan
    loaded, loaded_state, manifest = load_param_shards(tmp_path / "ckpt", step4)
    assert manifest.step == 3
    for a, b in zip(
        model_space_state(step4, loaded_state), model_space_state(step8, state), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Two more steps at 4 devices, fed the gradients of the 8-device run's steps 3 and 4.
    ref_params, _ = run_reference(8, params)
    mesh, layout, update = step4.mesh, step4.layout, step4.rows_update

    def body(p, s, g):
        u, s = update(g, s, p, ("dp",))
        return optax.apply_updates(p, u), s

    run = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(P("dp"), step4.state_specs, P("dp")),
            out_specs=(P("dp"), step4.state_specs),
        )
    )
    for k in (3, 4):
        grads = shard_params(mean_in_device_order(local_grads(8, k), 8), mesh, layout)
        loaded, loaded_state = run(loaded, loaded_state, grads)
    got = unshard_params(loaded, layout)
    assert_tree_close(got, ref_params, atol_rel=1e-6, check_dtype=True, what="parameters")
