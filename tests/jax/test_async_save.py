"""Saves that do not stop training in JAX (``blocking=False``; docs/checkpoints.md).

One process, 4 of its 8 CPU devices: ``save_optimizer_state`` and ``save_param_shards``
return before their files are written, while the training step goes on donating the very
buffers the save read; the writer is held until it has, and the checkpoint must still hold
the state at the call, bitwise, in JAX at another device count and in torch at world size 1.
The staging buffer is allocated once and holds the rank files' bytes (plus the shards'
padding).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

from gradsync_core import read_manifest
from gradsync_core.checkpoint import read_header, save_hook
from gradsync_jax import (
    load_optimizer_state,
    load_param_shards,
    make_local,
    param_layout,
    save_optimizer_state,
    save_param_shards,
    shard_optimizer,
    shard_params,
    unshard_params,
    zero3_step,
)
from gradsync_jax.checkpoint.staging import STAGING
from tests.faults import jax_save_worker as problem
from tests.jax import zero3_problem as z3
from tests.jax.async_save_problem import optax_moments, torch_moments
from tests.support.meshes import dp_mesh, mesh_of

SAVED_STEPS, MORE_STEPS = 3, 3


def loss_fn(params: dict, x: jax.Array, y: jax.Array) -> jax.Array:
    h = jnp.tanh(x @ params["dense"]["kernel"] + params["dense"]["bias"])
    return jnp.mean((h @ params["head"]["kernel"] + params["head"]["bias"] - y) ** 2)


def batch(tx: Any, step: int) -> tuple[jax.Array, jax.Array]:
    """Step ``step``'s batch, split over the data-parallel devices."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(8, 6)).astype(np.float32)
    split = jax.sharding.NamedSharding(tx.mesh, P("dp"))
    return jax.device_put(x, split), jax.device_put(np.sin(x[:, :3]), split)


def train_step(tx: Any, params: Any) -> Any:
    """One data-parallel step that donates the parameters and the state it is given."""
    specs = tx.state_specs(params)

    def body(p: Any, s: Any, x: Any, y: Any) -> Any:
        grads = jax.grad(loss_fn)(make_local(p), x, y)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s

    mapped = jax.shard_map(
        body, mesh=tx.mesh, in_specs=(P(), specs, P("dp"), P("dp")), out_specs=(P(), specs)
    )
    return jax.jit(mapped, donate_argnums=(0, 1))


@contextlib.contextmanager
def held_writer() -> Iterator[threading.Event]:
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(10)):
        try:
            yield release
        finally:
            release.set()


def host(tree: Any) -> Any:
    return jax.tree.map(lambda leaf: np.array(leaf, copy=True), tree)


def staged_bytes_of(path: str) -> int:
    """The tensor bytes of every rank file of ``path`` (their data sections)."""
    version = os.path.realpath(path)
    total = 0
    for name in read_manifest(path).files:
        _, start = read_header(os.path.join(version, name))
        total += os.path.getsize(os.path.join(version, name)) - start
    return total


def test_a_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    tx, params = problem.problem()  # Adam on 4 devices, greedy
    params = jax.device_put(params, jax.sharding.NamedSharding(tx.mesh, P()))
    state = tx.init(params)
    step = train_step(tx, params)
    for i in range(SAVED_STEPS):
        params, state = step(params, state, *batch(tx, i))
    at_call = host(tx.gather_state(state, params))
    weights = host(params)
    path = str(tmp_path / "ckpt")
    with held_writer() as release:
        handle = save_optimizer_state(
            path, tx, state, params, step=SAVED_STEPS, model=params, blocking=False
        )
        assert not handle.done()
        for i in range(MORE_STEPS):  # donates the buffers the save was given
            params, state = step(params, state, *batch(tx, SAVED_STEPS + i))
        release.set()
    assert handle.wait(timeout=60).step == SAVED_STEPS
    assert not np.array_equal(
        host(tx.gather_state(state, params))[0].mu["dense"]["kernel"],
        at_call[0].mu["dense"]["kernel"],
    )

    eight = shard_optimizer(optax.adam(1e-2), mesh_of(8))
    loaded, _ = load_optimizer_state(path, eight, weights)  # another device count
    got = host(eight.gather_state(loaded, weights))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(at_call), strict=True):
        assert np.array_equal(a, b)
    want = optax_moments(at_call[0])
    got_torch = torch_moments(path)  # the other framework, world size 1
    assert sorted(got_torch) == sorted(want)
    for key in want:
        assert np.array_equal(got_torch[key], want[key]), key

    # Staging: the devices' shards as they lie (the rank files' bytes, plus the padding that
    # makes each state leaf divide over the 4 devices), allocated once and reused.
    leaves = jax.tree.leaves((state.inner, dict(state.shards), params))
    assert STAGING.nbytes == sum(leaf.nbytes for leaf in leaves if leaf.ndim)
    padding = sum(
        leaf.size - np.size(p)
        for leaf, p in zip(jax.tree.leaves(state.inner[0].mu), jax.tree.leaves(params), strict=True)
    )
    assert STAGING.nbytes == staged_bytes_of(path) + 2 * 4 * padding  # mu and nu, float32
    buffer = STAGING._buffer
    save_optimizer_state(path, tx, state, params, step=9, model=params, blocking=False).wait()
    assert STAGING._buffer is buffer


def zero3(n: int) -> Any:
    """The ZeRO-3 step of tests/jax/zero3_problem.py on ``n`` devices."""
    layout = param_layout(z3.init_params(), world_size=n, units=z3.UNITS, frozen=z3.FROZEN)
    return zero3_step(z3.loss_fn, z3.adamw(), dp_mesh(n), layout)


def test_a_zero3_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    four = zero3(4)
    params = shard_params(z3.init_params(), four.mesh, four.layout)
    opt_state = four.init(params)
    for _ in range(2):
        params, opt_state, _ = four(params, opt_state, z3.data())
    at_call = host((unshard_params(params, four.layout), opt_state))
    path = str(tmp_path / "zero3")
    with held_writer() as release:
        handle = save_param_shards(path, four, params, opt_state, step=2, blocking=False)
        for _ in range(2):
            params, opt_state, _ = four(params, opt_state, z3.data())
        release.set()
    assert handle.wait(timeout=60).step == 2
    two = zero3(2)
    loaded, state, _ = load_param_shards(path, two)
    got_params = host(unshard_params(loaded, two.layout))
    for a, b in zip(jax.tree.leaves(got_params), jax.tree.leaves(at_call[0]), strict=True):
        assert np.array_equal(a, b)
    got_mu = host(unshard_params(state[0].mu, two.layout))
    want_mu = host(unshard_params(at_call[1][0].mu, four.layout))
    for a, b in zip(jax.tree.leaves(got_mu), jax.tree.leaves(want_mu), strict=True):
        assert np.array_equal(a, b)


def test_a_pipeline_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    """``save_pipeline(blocking=False)`` at pp 2: once it returns, the arrays it was given are
    deleted (what a donating step does to them) while the writer is held; the checkpoint
    still loads at pp 4 with the parameters and Adam state of the call, bitwise."""
    from gradsync_core import Topology, plan_pipeline
    from gradsync_jax import mesh_from_topology
    from gradsync_jax.pipeline import (
        load_pipeline,
        natural_params,
        pipeline_params,
        pipeline_step,
        save_pipeline,
    )
    from tests.jax.pipeline_problem import MODEL, init_params
    from tests.support.asserts import assert_tree_equal

    def plan(schedule: str, pp: int) -> Any:
        return plan_pipeline(
            schedule=schedule,
            microbatches=4,
            topology=Topology.create(8, pp=pp),
            layers=4,
            stages_per_rank=1,
            input_weight=0,
            output_weight=0,
        )

    inner = optax.adam(1e-2)
    natural = init_params(4)
    rng = np.random.default_rng(1)
    saved_state = jax.tree.map(
        lambda x: rng.normal(size=np.shape(x)).astype(np.float32), inner.init(natural)
    )
    saved_state = (saved_state[0]._replace(count=np.int32(3)), *saved_state[1:])
    first = plan("1F1B", 2)
    mesh = mesh_from_topology(first.topology)
    step = pipeline_step(MODEL, inner, mesh, first)
    params = pipeline_params(natural, first, mesh)
    state = step.pipeline_state(saved_state, params)
    path = tmp_path / "pipeline"
    with held_writer() as release:
        handle = save_pipeline(path, step, params, state, step=3, blocking=False)
        assert not handle.done()
        for leaf in jax.tree.leaves((params, state)):
            if isinstance(leaf, jax.Array) and not leaf.is_deleted():
                leaf.delete()
        release.set()
    assert handle.wait(timeout=60).step == 3
    second = plan("1F1B", 4)
    other = pipeline_step(MODEL, inner, mesh_from_topology(second.topology), second)
    loaded, loaded_state, _ = load_pipeline(path, other, natural)
    assert_tree_equal(natural_params(loaded, second), natural)
    assert_tree_equal(other.natural_state(loaded_state, loaded), saved_state, same_structure=True)
