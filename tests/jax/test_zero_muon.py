"""optax.contrib.muon under shard_optimizer: each matrix whole on its planned owner, exactly.

The parameters are a GPT's (``gpt_params``: the tree of examples/pipeline_models.gpt_blocks
in Flax names, so its torch names are the torch model's): Muon orthogonalizes the hidden
layers' matrices, AdamW (Muon's own partition) steps the embeddings, norms, biases and the
output layer. On 8 CPU devices, 5 steps, every device with its own local gradient: parameters
and the whole optimizer state equal the unsharded optimizer fed the mean of the local
gradients (the tolerance of tests/jax/test_zero.py), each matrix stepped by the owner of
``gradsync_core.plan_matrix_owners``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import plan_matrix_owners
from gradsync_jax import NotElementwiseError, shard_optimizer, torch_specs
from tests.jax.muon_problem import HIDDEN, LAYERS, gpt_params, gpt_shapes, muon
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import mean_in_device_order

STEPS = 5


def local_grads(n: int, step: int) -> dict:
    rng = np.random.default_rng(1000 + 37 * n + step)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 1, (n, *s)), jnp.float32),
        gpt_shapes(),
        is_leaf=lambda x: isinstance(x, tuple),
    )


def run_sharded(tx, n: int, params: dict) -> tuple[dict, object]:
    mesh = mesh_of(n)
    specs = tx.state_specs(params)

    def body(params, state, grads):
        grads = jax.tree.map(lambda g: g[0], grads)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs))
    )
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = tx.init(params)
    for s in range(STEPS):
        params, state = step(
            params, state, jax.device_put(local_grads(n, s), NamedSharding(mesh, P("dp")))
        )
    return params, tx.gather_state(state, params)


def run_reference(tx, n: int, params: dict) -> tuple[dict, object]:
    update = jax.jit(tx.update)
    state = tx.init(params)
    for s in range(STEPS):
        updates, state = update(mean_in_device_order(local_grads(n, s), n), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


@pytest.mark.slow  # 17 s on the 2-core machine: 8 devices' branches compiled
def test_muon_on_8_devices_equals_unsharded() -> None:
    """The default partition ("auto") is greedy with the planned owners (as "greedy" is)."""
    n, params = 8, gpt_params()
    tx = shard_optimizer(muon(), mesh_of(n))
    layout = tx.layout(params)
    assert type(layout).__name__ == "GreedyLayout"
    greedy = shard_optimizer(muon(), mesh_of(n), partition="greedy")
    assert greedy.plan(params) == layout.plan
    # Every hidden matrix on the owner the core plans by Newton-Schulz work.
    plan = tx.matrix_plan(params)
    assert plan is not None and plan.cost == "newton_schulz"
    assert len(plan.matrices) == 4 * LAYERS
    owner_of = {s.name: s.rank for s in layout.plan.shards}
    for layer in range(1, LAYERS + 1):
        for m in HIDDEN:
            assert owner_of[f"{layer}/{m}/kernel"] == plan.owner(f"{layer}.{m}.weight")
    got_params, got_state = run_sharded(tx, n, params)
    ref_params, ref_state = run_reference(muon(), n, params)
    assert_tree_close(got_params, ref_params, atol_rel=1e-6, check_dtype=True, what="parameters")
    assert_tree_close(got_state, ref_state, atol_rel=1e-6, check_dtype=True, what="state")
    moved = max(
        np.abs(np.asarray(a) - np.asarray(b)).max()
        for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(params), strict=True)
    )
    assert moved > 1e-3  # the optimizer really moved the parameters


def test_matrix_plan_is_the_torch_one_of_the_same_model() -> None:
    """The JAX plan is the core's plan of the torch specs of the same matrices (the torch
    MatrixOptimizer's, tests/parity/test_matrix_plans.py)."""
    params = gpt_params()
    tx = shard_optimizer(muon(), mesh_of(4))
    specs = [
        s
        for s in torch_specs(params)
        if s.name.split(".")[1] in HIDDEN and s.name.endswith(".weight")
    ]
    expected = plan_matrix_owners(specs, world_size=4)
    assert tx.matrix_plan(params).fingerprint == expected.fingerprint


def test_flat_refuses_muon_naming_the_owner_path() -> None:
    with pytest.raises(
        NotElementwiseError, match=r"orthogonalizes each matrix.*plan_matrix_owners"
    ):
        shard_optimizer(muon(), mesh_of(2), partition="flat")


def test_checkpoint_continues_at_another_device_count(tmp_path) -> None:
    """Saved from 8 devices, loaded on 4 (each matrix now with another owner): the state in
    model space comes back bit for bit."""
    from gradsync_jax import load_optimizer_state, save_optimizer_state

    params = gpt_params()
    rng = np.random.default_rng(7)
    whole = jax.tree.map(
        lambda x: (
            x + jnp.asarray(rng.normal(0, 1, np.shape(x)), x.dtype)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
        ),
        muon().init(params),
    )
    tx8 = shard_optimizer(muon(), mesh_of(8))
    save_optimizer_state(tmp_path / "muon", tx8, tx8.scatter_state(whole, params), params, step=3)
    tx4 = shard_optimizer(muon(), mesh_of(4))
    assert tx4.matrix_plan(params) != tx8.matrix_plan(params)
    loaded, manifest = load_optimizer_state(tmp_path / "muon", tx4, params)
    assert manifest.step == 3
    got = jax.tree.leaves(tx4.gather_state(loaded, params))
    for a, b in zip(got, jax.tree.leaves(whole), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
