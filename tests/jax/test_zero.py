"""shard_optimizer equals the unsharded Optax optimizer: parameters AND optimizer state.

Every device gets its own local gradient (a slice of a ``(N, ...)`` array sharded over
``dp``); the reference is the same Optax optimizer on one device fed the mean of the local
gradients, summed in device order (what ``psum_scatter`` does on CPU). Tolerance: every leaf
within ``1e-5`` relative plus ``1e-6`` of the leaf's largest magnitude; in practice greedy
SGD, Lion, RMSProp and Adafactor come out bitwise equal and the rest within a few ulps (XLA
fuses the update math differently from the unsharded program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import plan_greedy_shards
from gradsync_jax import (
    NotElementwiseError,
    ZeroState,
    clip_by_global_norm,
    param_specs,
    shard_optimizer,
)
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import mean_in_device_order, random_params

STEPS = 10
SHAPES = {  # six tensors: on 8 devices the greedy plan leaves two devices with nothing
    "dense_0": {"kernel": (8, 16), "bias": (16,)},
    "dense_1": {"kernel": (16, 12), "bias": (12,)},
    "head": {"kernel": (12, 4), "bias": (4,)},
}


def optimizers() -> dict[str, optax.GradientTransformation]:
    return {
        "sgd_momentum": optax.sgd(0.05, momentum=0.9),
        "adam": optax.adam(1e-2),
        "adamw": optax.adamw(1e-2, weight_decay=0.1),
        "lion": optax.lion(1e-3, weight_decay=0.01),
        "rmsprop": optax.rmsprop(1e-2),
        "lamb": optax.lamb(1e-2),
        # min_dim_size_to_factor=4 so the small kernels really get factored moments.
        "adafactor": optax.adafactor(1e-2, min_dim_size_to_factor=4),
    }


ELEMENTWISE = ("sgd_momentum", "adam", "adamw", "lion", "rmsprop")
OPTIMIZERS = optimizers()


def local_grads(n: int, step: int) -> dict:
    """``(n, ...)`` per leaf: row d is device d's local gradient at ``step``."""
    rng = np.random.default_rng(1000 + 37 * n + step)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, 1, (n, *s)), jnp.float32),
        SHAPES,
        is_leaf=lambda x: isinstance(x, tuple),
    )


_REFERENCE: dict[str, object] = {}


def reference_update(name: str, tx: optax.GradientTransformation):
    """One jitted unsharded step per optimizer, shared by all device counts (same shapes)."""
    if name not in _REFERENCE:

        @jax.jit
        def update(grads, state, params):
            updates, state = tx.update(grads, state, params)
            return updates, state

        _REFERENCE[name] = update
    return _REFERENCE[name]


def run_reference(name: str, tx, n: int, params: dict, steps: int = STEPS):
    update = reference_update(name, tx)
    apply = jax.jit(optax.apply_updates)
    state = tx.init(params)
    for step in range(steps):
        updates, state = update(mean_in_device_order(local_grads(n, step), n), state, params)
        params = apply(params, updates)
    return params, state


def sharded_step(txs: list, params: dict, mesh, *, jit: bool = True):
    """One shard_map running every transformation of ``txs`` on its own copy of params."""
    specs = tuple(tx.state_specs(params) for tx in txs)

    def body(params_list, states, grads):
        grads = jax.tree.map(lambda g: g[0], grads)  # this device's local gradient
        new_params, new_states = [], []
        for tx, p, s in zip(txs, params_list, states, strict=True):
            updates, s = tx.update(grads, s, p)
            new_params.append(optax.apply_updates(p, updates))
            new_states.append(s)
        return tuple(new_params), tuple(new_states)

    mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), specs, P("dp")), out_specs=(P(), specs))
    return jax.jit(mapped) if jit else mapped


def run_sharded(txs: list, n: int, params: dict, *, steps: int = STEPS, jit: bool = True):
    mesh = mesh_of(n)
    step = sharded_step(txs, params, mesh, jit=jit)
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    params_list = tuple(jax.device_put(params, replicated) for _ in txs)
    states = tuple(tx.init(params) for tx in txs)
    for s in range(steps):
        params_list, states = step(params_list, states, jax.device_put(local_grads(n, s), sharded))
    return params_list, states


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4, 8])
def test_every_optimizer_matches_unsharded(n: int) -> None:
    params = random_params(SHAPES)
    mesh = mesh_of(n)
    combos = [(name, "greedy") for name in OPTIMIZERS] + [(name, "flat") for name in ELEMENTWISE]
    txs = [shard_optimizer(OPTIMIZERS[name], mesh, partition=part) for name, part in combos]
    params_list, states = run_sharded(txs, n, params)
    for (name, part), tx, p, s in zip(combos, txs, params_list, states, strict=True):
        ref_params, ref_state = run_reference(name, OPTIMIZERS[name], n, params)
        what = f"{name} partition={part} on {n} devices"
        assert_tree_close(
            p, ref_params, atol_rel=1e-6, check_dtype=True, what=f"parameters of {what}"
        )
        assert_tree_close(
            tx.gather_state(s, params),
            ref_state,
            atol_rel=1e-6,
            check_dtype=True,
            what=f"optimizer state of {what}",
        )
        # The state really moved (moments are not still zero): the comparison can fail.
        moved = [np.abs(np.asarray(x)).max() for x in jax.tree.leaves(ref_state) if np.size(x)]
        assert max(moved) > 0, what


@pytest.mark.slow
def test_without_jit_matches_unsharded() -> None:
    """Eager shard_map (no jax.jit): JAX compiles every primitive, so two steps, two optimizers."""
    n, params = 2, random_params(SHAPES)
    mesh = mesh_of(n)
    combos = [("lamb", "greedy"), ("adamw", "flat")]
    txs = [shard_optimizer(OPTIMIZERS[name], mesh, partition=part) for name, part in combos]
    params_list, states = run_sharded(txs, n, params, steps=2, jit=False)
    for (name, part), tx, p, s in zip(combos, txs, params_list, states, strict=True):
        ref_params, ref_state = run_reference(name, OPTIMIZERS[name], n, params, steps=2)
        assert_tree_close(
            p, ref_params, atol_rel=1e-6, check_dtype=True, what=f"{name} {part} without jit"
        )
        assert_tree_close(
            tx.gather_state(s, params),
            ref_state,
            atol_rel=1e-6,
            check_dtype=True,
            what=f"{name} {part} without jit",
        )


@pytest.mark.slow
def test_chain_clip_schedule_inject_hyperparams() -> None:
    """chain(clip_by_global_norm, inject_hyperparams(adamw)(schedule)) equals optax's own."""
    n, params = 4, random_params(SHAPES)
    mesh = mesh_of(n)
    schedule = optax.linear_schedule(1e-2, 1e-3, transition_steps=STEPS)
    max_norm = 2.0  # the local gradients' mean has norm ~5: every step clips

    def chain(clip):
        return optax.chain(
            clip(max_norm), optax.inject_hyperparams(optax.adamw)(learning_rate=schedule)
        )

    txs = [
        shard_optimizer(chain(clip_by_global_norm), mesh, partition=p) for p in ("greedy", "flat")
    ]
    params_list, states = run_sharded(txs, n, params)
    ref_tx = chain(optax.clip_by_global_norm)
    ref_params, ref_state = run_reference("clip_chain", ref_tx, n, params)
    norm = optax.tree.norm(mean_in_device_order(local_grads(n, 0), n))
    assert norm > 2 * max_norm, "the test must clip"
    for tx, p, s in zip(txs, params_list, states, strict=True):
        assert_tree_close(
            p, ref_params, atol_rel=1e-6, check_dtype=True, what=f"clipped chain, {tx.partition}"
        )
        assert_tree_close(
            tx.gather_state(s, params),
            ref_state,
            atol_rel=1e-6,
            check_dtype=True,
            what=f"clipped chain {tx.partition}",
        )
        lr = s.inner[1].hyperparams["learning_rate"]  # the inner state's own fields
        np.testing.assert_array_equal(lr, ref_state[1].hyperparams["learning_rate"])
    # Without clipping the result differs: the comparison above can fail.
    unclipped, _ = run_reference("unclipped", optax.adamw(schedule), n, params)
    assert not np.allclose(unclipped["head"]["kernel"], ref_params["head"]["kernel"])


def test_reduce_sum() -> None:
    """reduce="sum" feeds the inner optimizer the sum of the local gradients, not the mean."""
    n, params = 2, random_params(SHAPES)
    txs = [
        shard_optimizer(optax.sgd(0.01, momentum=0.9), mesh_of(n), partition=p, reduce="sum")
        for p in ("greedy", "flat")
    ]
    params_list, states = run_sharded(txs, n, params, steps=3)
    ref, ref_tx = params, optax.sgd(0.01, momentum=0.9)
    ref_state = ref_tx.init(ref)
    for step in range(3):
        grads = jax.tree.map(lambda g: g[0] + g[1], local_grads(n, step))
        updates, ref_state = ref_tx.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    for tx, p, s in zip(txs, params_list, states, strict=True):
        assert_tree_close(
            p, ref, atol_rel=1e-6, check_dtype=True, what=f"reduce=sum {tx.partition}"
        )
        assert_tree_close(
            tx.gather_state(s, params),
            ref_state,
            atol_rel=1e-6,
            check_dtype=True,
            what=f"reduce=sum {tx.partition}",
        )


@pytest.mark.parametrize("partition", ["greedy", "flat"])
def test_init_eval_shape_shardings_and_bytes(partition: str) -> None:
    n, params = 4, random_params(SHAPES)
    tx = shard_optimizer(optax.adam(1e-3), mesh_of(n), partition=partition)
    abstract = jax.eval_shape(
        tx.init, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), params)
    )
    state = tx.init(params)
    assert isinstance(state, ZeroState)
    shardings = tx.state_shardings(params)
    assert jax.tree.structure(abstract) == jax.tree.structure(state)
    for a, s, want in zip(
        jax.tree.leaves(abstract), jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True
    ):
        assert (a.shape, a.dtype) == (s.shape, s.dtype)
        assert s.sharding.is_equivalent_to(want, s.ndim), (s.sharding, want)
        # eval_shape's sharding lives on an AbstractMesh: compare the specs, padded to ndim.
        assert padded(a.sharding.spec, s.ndim) == padded(want.spec, s.ndim)
    # Bytes each device really holds equal the plan's figure, and are ~1/n of the unsharded.
    per_device: dict = {}
    for leaf in jax.tree.leaves(state):
        for shard in leaf.addressable_shards:
            per_device[shard.device] = per_device.get(shard.device, 0) + shard.data.nbytes
    assert len(set(per_device.values())) == 1
    held = next(iter(per_device.values()))
    assert held == tx.state_nbytes_per_device(params)
    unsharded = sum(x.nbytes for x in jax.tree.leaves(optax.adam(1e-3).init(params)))
    padding = 2 * 4 * (tx.plan(params).padding_numel + 3 * n)  # 2 moments, fp32
    assert held <= unsharded * (1 + tx.plan(params).imbalance) / n + padding + 8
    assert held < unsharded / 2


def padded(spec: P, ndim: int) -> tuple:
    return (*spec, *[None] * (ndim - len(spec)))


def test_greedy_owners_are_the_core_plan() -> None:
    params = random_params(SHAPES)
    tx = shard_optimizer(optax.adafactor(1e-3), mesh_of(8))
    assert tx.plan(params) == plan_greedy_shards(param_specs(params), world_size=8)
    flat = shard_optimizer(optax.adam(1e-3), mesh_of(8), partition="flat")
    assert all(b.numel % 8 == 0 for b in flat.plan(params).buckets.buckets)


# -- errors: one sentence each, raised before anything runs ----------------------------------


@pytest.mark.parametrize(
    "inner",
    [
        optax.lamb(1e-3),
        optax.adafactor(1e-3),
        # A mask by rank now runs flat (one bucket per parameter: test_zero_rules.py); a mask
        # by size sees an element range's size, not the parameter's, so flat still refuses it.
        optax.adamw(1e-3, mask=lambda p: jax.tree.map(lambda x: x.size > 12, p)),
        optax.chain(clip_by_global_norm(1.0), optax.lars(1e-3)),
    ],
    ids=["lamb", "adafactor", "adamw-size-mask", "lars"],
)
def test_flat_refuses_non_elementwise(inner) -> None:
    with pytest.raises(NotElementwiseError, match="use partition='greedy'"):
        shard_optimizer(inner, mesh_of(2), partition="flat")


@pytest.mark.parametrize(
    "inner",
    [
        optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)),
        optax.apply_if_finite(optax.adam(1e-3), 3),
    ],
    ids=["optax-clip", "apply-if-finite"],
)
@pytest.mark.parametrize("partition", ["greedy", "flat"])
def test_cross_parameter_transformations_refused(inner, partition) -> None:
    # Per-tensor partitions refuse them; "auto" runs them gathered (test_zero_coupled.py).
    with pytest.raises(ValueError, match="combines all parameters"):
        shard_optimizer(inner, mesh_of(2), partition=partition)


def test_bad_arguments() -> None:
    mesh = mesh_of(2)
    with pytest.raises(ValueError, match="partition must be one of"):
        shard_optimizer(optax.adam(1e-3), mesh, partition="zero3")
    with pytest.raises(ValueError, match="reduce must be"):
        shard_optimizer(optax.adam(1e-3), mesh, reduce="max")
    with pytest.raises(ValueError, match="not an axis of the mesh"):
        shard_optimizer(optax.adam(1e-3), mesh, axis_name="data")


def test_misuse_in_the_step_is_refused() -> None:
    n, params = 2, random_params(SHAPES)
    mesh = mesh_of(n)
    tx = shard_optimizer(optax.adam(1e-3), mesh)
    state = tx.init(params)
    grads = jax.tree.map(jnp.zeros_like, params)
    with pytest.raises(ValueError, match=r"must run inside jax\.shard_map"):
        tx.update(grads, state, params)

    specs = tx.state_specs(params)
    replicated = NamedSharding(mesh, P())

    def summed_already(p, s):  # gradients invariant over dp: jax.grad already summed them
        return tx.update(jax.tree.map(jnp.ones_like, p), s, p)

    with pytest.raises(ValueError, match="already summed"):
        jax.jit(
            jax.shard_map(summed_already, mesh=mesh, in_specs=(P(), specs), out_specs=(P(), specs))
        )(jax.device_put(params, replicated), state)

    replicated_specs = jax.tree.map(lambda _: P(), specs, is_leaf=lambda x: isinstance(x, P))

    def local(p, s, g):
        return tx.update(jax.tree.map(lambda x: x[0], g), s, p)

    with pytest.raises(ValueError, match=r"in_specs=tx\.state_specs"):
        jax.jit(
            jax.shard_map(
                local,
                mesh=mesh,
                in_specs=(P(), replicated_specs, P("dp")),
                out_specs=(P(), replicated_specs),
            )
        )(
            jax.device_put(params, replicated),
            jax.device_put(state, replicated),
            jax.device_put(local_grads(n, 0), NamedSharding(mesh, P("dp"))),
        )

    # Under greedy the global norm is handed to the clip, so it must be first; "auto" runs
    # a clip anywhere gathered (test_zero_coupled.py).
    clip_second = shard_optimizer(
        optax.chain(optax.scale(0.5), clip_by_global_norm(1.0), optax.adam(1e-3)),
        mesh,
        partition="greedy",
    )
    with pytest.raises(ValueError, match="must be the first transformation"):
        run_sharded([clip_second], n, params, steps=1)
