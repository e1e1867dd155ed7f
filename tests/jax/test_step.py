"""data_parallel_step on 8 CPU devices vs the single-device full-batch reference.

Parameters AND optimizer state (Adam's mu/nu/count) are compared: Adam is nearly scale
invariant, so a step that used N times the gradient would still move the parameters almost
right — its moments would not (docs/design.md §7). Tolerance: rtol 1e-5, atol 1e-5 x the leaf's
largest magnitude (the mean of 8 shard means is the full-batch mean up to rounding).
"""

from __future__ import annotations

import re

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
    sync_gradients,
    value_and_local_grad,
)
from gradsync_jax._specs import param_specs
from tests.jax.multiprocess_worker import make_loss, make_problem

DP = 8
MODEL, PARAMS, BATCH = make_problem(batch=32)
LOSS = make_loss(MODEL)
MESH = mesh_from_topology(Topology.create(DP))
OPTIMIZERS = {"adam": lambda: optax.adam(1e-2), "sgd": lambda: optax.sgd(0.1, momentum=0.9)}


def _reference(tx, steps: int, params=PARAMS, batch=BATCH):
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


def _run(step, tx, steps: int):
    params, state, losses = PARAMS, tx.init(PARAMS), []
    for _ in range(steps):
        params, state, loss = step(params, state, BATCH)
        losses.append(loss)
    return params, state, losses


def _assert_close(actual, expected, *, rtol=1e-5) -> None:
    leaves_a, leaves_e = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(leaves_a) == len(leaves_e)
    for a, e in zip(leaves_a, leaves_e, strict=True):
        e = np.asarray(e)
        np.testing.assert_allclose(np.asarray(a), e, rtol=rtol, atol=rtol * np.abs(e).max())


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_step_equals_single_device_full_batch(name: str) -> None:
    tx = OPTIMIZERS[name]()
    params, state, losses = _run(data_parallel_step(LOSS, tx, MESH), tx, 3)
    ref_params, ref_state, ref_losses = _reference(tx, 3)
    _assert_close(params, ref_params)
    _assert_close(state, ref_state)  # Adam mu, nu, count / SGD momentum trace
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    if name == "adam":
        assert int(state[0].count) == 3
    # Replicated outputs: every device holds the same parameters.
    leaf = jax.tree.leaves(params)[0]
    assert leaf.sharding.is_fully_replicated and len(leaf.addressable_shards) == DP


def test_auto_axis_mesh() -> None:
    """With Auto axes shard_map reshards the inputs itself; the result is the same."""
    tx = OPTIMIZERS["sgd"]()
    mesh = mesh_from_topology(Topology.create(DP), axis_types=AxisType.Auto)
    params, state, _ = _run(data_parallel_step(LOSS, tx, mesh), tx, 2)
    ref_params, ref_state, _ = _reference(tx, 2)
    _assert_close(params, ref_params)
    _assert_close(state, ref_state)


def test_reduce_sum_gives_dp_times_the_mean_gradient() -> None:
    tx = optax.adam(1e-2)
    _, mean_state, _ = _run(data_parallel_step(LOSS, tx, MESH), tx, 1)
    _, sum_state, _ = _run(data_parallel_step(LOSS, tx, MESH, reduce="sum"), tx, 1)
    _assert_close(sum_state[0].mu, jax.tree.map(lambda m: m * DP, mean_state[0].mu))
    _assert_close(sum_state[0].nu, jax.tree.map(lambda n: n * DP * DP, mean_state[0].nu))


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
    sm_params, sm_state, _ = _run(data_parallel_step(LOSS, tx, MESH), tx, 3)
    _assert_close(params, sm_params, rtol=1e-6)
    _assert_close(state, sm_state, rtol=1e-6)


def test_accumulation_equals_the_big_batch() -> None:
    tx = optax.adam(1e-2)
    params, state, losses = _run(data_parallel_step(LOSS, tx, MESH, accumulate_steps=4), tx, 3)
    ref_params, ref_state, ref_losses = _reference(tx, 3)
    _assert_close(params, ref_params)
    _assert_close(state, ref_state)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)


def _computations(hlo: str) -> dict[str, str]:
    """Compiled HLO text -> {computation name: body text}."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ )", hlo)
    named = {}
    for block in blocks:
        match = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block)
        if match:
            named[match.group(1)] = block
    return named


def _collectives_in_loops(hlo: str) -> tuple[int, int, int]:
    """(all-reduces in the program, while loops, all-reduces reachable from a loop body)."""
    comps = _computations(hlo)
    pattern = r"(?:body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)"
    bodies = re.findall(r"while\(.*?body=%([\w.\-]+)", hlo)
    seen, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += re.findall(pattern, comps[name])
    count = len(re.findall(r"all-reduce(?:-start)?\(", hlo))
    in_loops = sum(len(re.findall(r"all-reduce(?:-start)?\(", comps[n])) for n in seen)
    return count, len(bodies), in_loops


def test_accumulation_syncs_once_in_the_compiled_program() -> None:
    """k micro-steps run in a loop with no collective; the sync happens once after it."""
    tx = optax.sgd(0.1)
    state = tx.init(PARAMS)

    def compiled(step) -> str:
        return step.lower(PARAMS, state, BATCH).compile().as_text()

    once = compiled(data_parallel_step(LOSS, tx, MESH).jitted)
    accumulated = compiled(data_parallel_step(LOSS, tx, MESH, accumulate_steps=4).jitted)
    total_once, loops_once, _ = _collectives_in_loops(once)
    total, loops, in_loops = _collectives_in_loops(accumulated)
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
    _, _, naive_in_loops = _collectives_in_loops(
        naive.lower(*replicated, sharded).compile().as_text()
    )
    assert naive_in_loops >= 1


def test_bucketed_step_equals_the_default() -> None:
    tx = optax.adam(1e-2)
    plan = plan_buckets(param_specs(PARAMS), cap_bytes=2048, first_cap_bytes=1024)
    assert len(plan.buckets) > 1
    bucketed = _run(data_parallel_step(LOSS, tx, MESH, plan=plan), tx, 2)
    # The reduction is bitwise equal (test_sync); XLA fuses the Adam update around a
    # concatenated buffer differently, which moves some results by an ulp.
    _assert_close(bucketed[:2], _run(data_parallel_step(LOSS, tx, MESH), tx, 2)[:2], rtol=1e-6)


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
