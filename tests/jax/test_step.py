"""data_parallel_step on 8 CPU devices vs the single-device full-batch reference.

Parameters AND optimizer state (Adam's mu/nu/count) are compared: Adam is nearly scale
invariant, so a step that used N times the gradient would still move the parameters almost
right — its moments would not (docs/design.md §7). Tolerance: rtol 1e-5, atol 1e-5 x the leaf's
largest magnitude (the mean of 8 shard means is the full-batch mean up to rounding).
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.sharding import AxisType

from gradsync_core import Topology, plan_buckets
from gradsync_jax import (
    data_parallel_step,
    local_grad,
    mesh_from_topology,
    param_specs,
    shard_optimizer,
    sync_gradients,
    synced,
    value_and_local_grad,
)
from tests.jax.hlo import collectives_in_loops
from tests.jax.step_problem import (
    BATCH,
    DP,
    LOSS,
    MESH,
    OPTIMIZERS,
    PARAMS,
    reference_training,
    run_training,
)
from tests.support.asserts import assert_tree_close, assert_tree_equal


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n != "adam" else []) for n in OPTIMIZERS]
)
def test_step_equals_single_device_full_batch(name: str) -> None:
    tx = OPTIMIZERS[name]()
    params, state, losses = run_training(data_parallel_step(LOSS, tx, MESH), tx, 3)
    ref_params, ref_state, ref_losses = reference_training(tx, 3)
    assert_tree_close(params, ref_params)
    assert_tree_close(state, ref_state)  # Adam mu, nu, count / SGD momentum trace
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    if name == "adam":
        assert int(state[0].count) == 3
    # Replicated outputs: every device holds the same parameters.
    leaf = jax.tree.leaves(params)[0]
    assert leaf.sharding.is_fully_replicated and len(leaf.addressable_shards) == DP


COMPILE_CASES = {
    "plain": lambda: optax.adam(1e-2),
    "synced": lambda: optax.chain(synced("dp"), optax.adam(1e-2)),
    "shard_optimizer": lambda: shard_optimizer(optax.adam(1e-2), MESH),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(COMPILE_CASES))
def test_a_loop_from_unplaced_parameters_compiles_once(name: str, caplog) -> None:
    """The README's loop: parameters from ``model.init`` and a state from ``tx.init`` (one
    device), then 3 steps: one compilation, not one for the first step and another for the
    placed outputs (issue 33 item 8)."""
    tx = COMPILE_CASES[name]()
    step = data_parallel_step(LOSS, tx, MESH)
    params, state = PARAMS, tx.init(PARAMS)
    batch = jax.tree.map(np.asarray, BATCH)  # host arrays, as the README's loop makes them
    assert not isinstance(jax.tree.leaves(params)[0].sharding, jax.sharding.NamedSharding)
    with jax.log_compiles(True), caplog.at_level(logging.WARNING):
        for _ in range(3):
            params, state, _ = step(params, state, batch)
    compiles = [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]
    assert len(compiles) == 1, [c[:90] for c in compiles]
    assert_tree_close(params, reference_training(optax.adam(1e-2), 3)[0])


@pytest.mark.slow
def test_compilations_log_at_info_and_are_silent_by_default(caplog) -> None:
    """Issue 33 item 9: each step's compilation logs ``compiling ...`` and ``compiled ... in``
    through its module's logger at INFO; gradsync adds no handler and sets no level."""
    from gradsync_jax import param_layout, shard_params, zero3_step

    names = ("data_parallel.step", "param_sharding.step", "zero.transform")
    loggers = [logging.getLogger(f"gradsync_jax.{n}") for n in names]
    assert all(not lg.handlers and lg.level == logging.NOTSET for lg in loggers)

    def train() -> None:  # new steps: each compiles on its first call
        tx = shard_optimizer(optax.adam(1e-2), MESH)
        step = data_parallel_step(LOSS, tx, MESH)
        step(PARAMS, tx.init(PARAMS), BATCH)
        layout = param_layout(PARAMS, world_size=DP)
        zero3 = zero3_step(LOSS, optax.adam(1e-2), MESH, layout)
        sharded = shard_params(PARAMS, MESH, layout)
        zero3(sharded, zero3.init(sharded), BATCH)

    train()
    assert not [r for r in caplog.records if r.name.startswith("gradsync_jax")]
    with caplog.at_level(logging.INFO, logger="gradsync_jax"):
        train()
    got = [(r.name, r.levelno, r.getMessage()) for r in caplog.records]
    elements = sum(x.size for x in jax.tree.leaves(PARAMS))
    count = len(jax.tree.leaves(PARAMS))
    for logger, what in [
        ("zero.transform", "shard_optimizer's init"),
        ("data_parallel.step", "data_parallel_step"),
        ("param_sharding.step", "zero3_step's optimizer init"),
        ("param_sharding.step", "zero3_step"),
    ]:
        name = f"gradsync_jax.{logger}"
        start = f"compiling {what} for {count} parameters ({elements:,} elements)"
        assert (name, logging.INFO, start) in got, (start, got)
        assert any(n == name and m.startswith(f"compiled {what} in ") for n, _, m in got), what


@pytest.mark.slow
def test_auto_axis_mesh() -> None:
    """With Auto axes shard_map reshards the inputs itself; the result is the same."""
    tx = OPTIMIZERS["sgd"]()
    mesh = mesh_from_topology(Topology.create(DP), axis_types=AxisType.Auto)
    params, state, _ = run_training(data_parallel_step(LOSS, tx, mesh), tx, 2)
    ref_params, ref_state, _ = reference_training(tx, 2)
    assert_tree_close(params, ref_params)
    assert_tree_close(state, ref_state)


@pytest.mark.slow
def test_reduce_sum_gives_dp_times_the_mean_gradient() -> None:
    tx = optax.adam(1e-2)
    _, mean_state, _ = run_training(data_parallel_step(LOSS, tx, MESH), tx, 1)
    sum_tx = optax.chain(synced("dp", reduce="sum"), optax.adam(1e-2))
    _, sum_state, _ = run_training(data_parallel_step(LOSS, sum_tx, MESH), sum_tx, 1)
    sum_state = sum_state[1]  # after synced's (array-free) state
    assert_tree_close(sum_state[0].mu, jax.tree.map(lambda m: m * DP, mean_state[0].mu))
    assert_tree_close(sum_state[0].nu, jax.tree.map(lambda n: n * DP * DP, mean_state[0].nu))


@pytest.mark.slow
def test_plain_tx_gets_the_default_sync_and_equals_an_explicit_synced() -> None:
    """A plain Optax tx still trains on the global mean: the step puts synced() in front."""
    tx = optax.adam(1e-2)
    chained = optax.chain(synced("dp"), optax.adam(1e-2))
    plain = run_training(data_parallel_step(LOSS, tx, MESH), tx, 2)
    explicit = run_training(data_parallel_step(LOSS, chained, MESH), chained, 2)
    assert jax.tree.leaves(explicit[1][0]) == []  # synced keeps no arrays
    assert_tree_equal(plain[0], explicit[0])
    assert_tree_equal(plain[1], explicit[1][1])
    np.testing.assert_array_equal(plain[2], explicit[2])


def test_synced_alone_is_sync_gradients() -> None:
    """synced() used by hand in a shard_map: its update is exactly sync_gradients."""
    from jax.sharding import PartitionSpec as P

    plan = plan_buckets(param_specs(PARAMS), cap_bytes=2048, first_cap_bytes=1024)
    tx = synced("dp", plan=plan, reduce_dtype=jnp.bfloat16)
    state = tx.init(PARAMS)

    def both(params, batch):
        grads = local_grad(LOSS)(params, batch)
        updates, _ = tx.update(grads, state, params)
        return updates, sync_gradients(grads, "dp", plan=plan, reduce_dtype=jnp.bfloat16)

    mapped = jax.jit(jax.shard_map(both, mesh=MESH, in_specs=(P(), P("dp")), out_specs=(P(), P())))
    params = jax.device_put(PARAMS, jax.sharding.NamedSharding(MESH, P()))
    batch = jax.device_put(BATCH, jax.sharding.NamedSharding(MESH, P("dp")))
    updates, expected = mapped(params, batch)
    assert_tree_equal(updates, expected)
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum'"):
        synced("dp", reduce="max")


def test_two_syncs_or_another_axis_are_refused() -> None:
    twice = optax.chain(synced("dp"), synced("dp"), optax.sgd(0.1))
    with pytest.raises(ValueError, match="tx syncs the gradients 2 times"):
        data_parallel_step(LOSS, twice, MESH)(PARAMS, twice.init(PARAMS), BATCH)
    other = optax.chain(synced(("dp",)), optax.sgd(0.1))  # same axis as a tuple: accepted
    data_parallel_step(LOSS, other, MESH)(PARAMS, other.init(PARAMS), BATCH)
    elsewhere = optax.chain(synced("pp"), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"tx holds synced\('pp'\) but the step's batch"):
        data_parallel_step(LOSS, elsewhere, MESH)(PARAMS, elsewhere.init(PARAMS), BATCH)


@pytest.mark.slow
def test_pmap_path_equals_shard_map_path() -> None:
    tx = optax.adam(1e-2)

    def local_step(params, state, batch):
        loss, grads = value_and_local_grad(LOSS)(params, batch)
        grads = sync_gradients(grads, "dp")
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, lax.pmean(loss, "dp")

    pstep = jax.pmap(local_step, axis_name="dp", in_axes=(None, None, 0))
    shards = jax.tree.map(lambda a: a.reshape(DP, -1, *a.shape[1:]), BATCH)
    params, state = PARAMS, tx.init(PARAMS)
    for _ in range(3):
        # pmap returns one copy per device; all equal, so carry device 0's.
        params, state, _ = jax.tree.map(lambda a: a[0], pstep(params, state, shards))
    sm_params, sm_state, _ = run_training(data_parallel_step(LOSS, tx, MESH), tx, 3)
    assert_tree_close(params, sm_params, rtol=1e-6)
    assert_tree_close(state, sm_state, rtol=1e-6)


@pytest.mark.slow
def test_accumulation_equals_the_big_batch() -> None:
    tx = optax.adam(1e-2)
    params, state, losses = run_training(
        data_parallel_step(LOSS, tx, MESH, accumulate_steps=4), tx, 3
    )
    ref_params, ref_state, ref_losses = reference_training(tx, 3)
    assert_tree_close(params, ref_params)
    assert_tree_close(state, ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


@pytest.mark.slow
def test_accumulation_syncs_once_in_the_compiled_program() -> None:
    """k micro-steps run in a loop with no collective; the sync happens once after it."""
    tx = optax.sgd(0.1)
    state = tx.init(PARAMS)

    def compiled(step) -> str:
        return jax.jit(step).lower(PARAMS, state, BATCH).compile().as_text()

    once = compiled(data_parallel_step(LOSS, tx, MESH))
    accumulated = compiled(data_parallel_step(LOSS, tx, MESH, accumulate_steps=4))
    total_once, loops_once, _ = collectives_in_loops(once)
    total, loops, in_loops = collectives_in_loops(accumulated)
    assert loops_once == 0 and loops >= 1, "the micro-steps should compile to a loop"
    assert in_loops == 0
    assert total == total_once >= 1

    # Control: syncing inside every micro-step puts the all-reduce in the loop body, which
    # the counter sees (so the assertion above can fail).
    def sync_each_micro_step(params, state, batch):
        micro = jax.tree.map(lambda a: a.reshape(4, -1, *a.shape[1:]), batch)

        def body(acc, mb):
            grads = sync_gradients(local_grad(LOSS)(params, mb), "dp")
            return jax.tree.map(jnp.add, acc, grads), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        grads, _ = lax.scan(body, zeros, micro)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    from jax.sharding import PartitionSpec as P

    naive = jax.jit(
        jax.shard_map(
            sync_each_micro_step, mesh=MESH, in_specs=(P(), P(), P("dp")), out_specs=(P(), P())
        )
    )
    sharded = jax.device_put(BATCH, jax.sharding.NamedSharding(MESH, P("dp")))
    replicated = jax.device_put((PARAMS, state), jax.sharding.NamedSharding(MESH, P()))
    _, _, naive_in_loops = collectives_in_loops(
        naive.lower(*replicated, sharded).compile().as_text()
    )
    assert naive_in_loops >= 1


@pytest.mark.slow
def test_bucketed_step_equals_the_default() -> None:
    tx = optax.adam(1e-2)
    plan = plan_buckets(param_specs(PARAMS), cap_bytes=2048, first_cap_bytes=1024)
    assert len(plan.buckets) > 1
    bucketed_tx = optax.chain(synced("dp", plan=plan), optax.adam(1e-2))
    params, state, _ = run_training(data_parallel_step(LOSS, bucketed_tx, MESH), bucketed_tx, 2)
    # The reduction is bitwise equal (test_sync); XLA fuses the Adam update around a
    # concatenated buffer differently, which moves some results by an ulp.
    assert_tree_close(
        (params, state[1]), run_training(data_parallel_step(LOSS, tx, MESH), tx, 2)[:2], rtol=1e-6
    )


def test_bad_input_gets_one_clear_sentence() -> None:
    tx = optax.sgd(0.1)
    with pytest.raises(ValueError, match="axis 'data' is not an axis of the mesh"):
        data_parallel_step(LOSS, tx, MESH, axis_name="data")
    with pytest.raises(ValueError, match="accumulate_steps must be a positive int"):
        data_parallel_step(LOSS, tx, MESH, accumulate_steps=0)
    step = data_parallel_step(LOSS, tx, MESH, accumulate_steps=2)
    x, y = BATCH
    with pytest.raises(ValueError, match=r"multiple of dp size 8 x accumulate_steps 2 = 16"):
        step(PARAMS, tx.init(PARAMS), (x[:24], y[:24]))


@pytest.mark.slow
@pytest.mark.parametrize(
    "make_tx",
    [
        lambda: optax.polyak_sgd(max_learning_rate=0.5),
        lambda: optax.chain(
            optax.sgd(0.1), optax.contrib.reduce_on_plateau(patience=1, cooldown=0, factor=0.5)
        ),
    ],
    ids=["polyak_sgd", "reduce_on_plateau"],
)
def test_loss_is_passed_as_extra_argument(make_tx) -> None:
    """loss_as="value": tx.update gets the global mean loss, as on one device with the batch."""
    tx = make_tx()
    params, state, losses = run_training(data_parallel_step(LOSS, tx, MESH, loss_as="value"), tx, 4)

    @jax.jit
    def reference_step(params, state):
        loss, grads = jax.value_and_grad(LOSS)(params, BATCH)
        updates, state = tx.update(grads, state, params, value=loss)
        return optax.apply_updates(params, updates), state, loss

    ref_params, ref_state, ref_losses = PARAMS, tx.init(PARAMS), []
    for _ in range(4):
        ref_params, ref_state, loss = reference_step(ref_params, ref_state)
        ref_losses.append(loss)
    assert_tree_close(params, ref_params)
    assert_tree_close(state, ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    # polyak's step size is value / |g|^2 and reduce_on_plateau's state keeps the best
    # value: a wrong or missing loss changes the parameters or the state.


def test_loss_as_must_be_a_name() -> None:
    with pytest.raises(ValueError, match="loss_as must be the name"):
        data_parallel_step(LOSS, optax.sgd(0.1), MESH, loss_as="the loss")
