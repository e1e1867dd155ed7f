"""sync_gradients: the local-gradient contract (docs/design.md §7), mean/sum, dtype, buckets."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_buckets
from gradsync_jax import (
    local_grad,
    make_local,
    mesh_from_topology,
    param_specs,
    sync_gradients,
    torch_names,
    torch_specs,
)
from tests.support.asserts import assert_tree_close, assert_tree_equal

DP = 8


def _params() -> dict:
    rng = np.random.default_rng(0)
    return {
        f"layer_{i}": {
            "kernel": jnp.asarray(rng.normal(0, 0.3, (12, 12)), jnp.float32),
            "bias": jnp.asarray(rng.normal(0, 0.1, (12,)), jnp.float32),
        }
        for i in range(3)
    }


def _loss(params: dict, x: jax.Array) -> jax.Array:
    for i in range(3):
        x = jnp.tanh(x @ params[f"layer_{i}"]["kernel"] + params[f"layer_{i}"]["bias"])
    return jnp.mean(x**2)


PARAMS = _params()
X = jnp.asarray(np.random.default_rng(1).normal(size=(4 * DP, 12)), jnp.float32)
MESH = mesh_from_topology(Topology.create(DP))


def _local_grads_reference() -> list:
    """Each device's gradient of its shard, computed one device at a time."""
    return [jax.grad(_loss)(PARAMS, shard) for shard in jnp.split(X, DP)]


def _run(body, *, mesh=MESH, check_vma=True, batch_axes="dp"):
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P(), P(batch_axes)), out_specs=P(), check_vma=check_vma
    )
    replicated, sharded = NamedSharding(mesh, P()), NamedSharding(mesh, P(batch_axes))
    return jax.jit(mapped)(jax.device_put(PARAMS, replicated), jax.device_put(X, sharded))


@pytest.mark.slow
def test_mean_and_sum_match_the_per_device_reference() -> None:
    local = _local_grads_reference()
    mean_ref = jax.tree.map(lambda *g: np.mean(np.stack(g), axis=0), *local)
    sum_ref = jax.tree.map(lambda *g: np.sum(np.stack(g), axis=0), *local)
    full_batch = jax.grad(_loss)(PARAMS, X)  # mean of equal shard means = full-batch mean

    mean = _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"))
    total = _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", reduce="sum"))
    assert_tree_close(mean, mean_ref)
    assert_tree_close(mean, full_batch)
    assert_tree_close(total, sum_ref)
    # Divide-before-sum by a power of two is exact: sum == dp * mean bit for bit.
    assert_tree_equal(total, jax.tree.map(lambda g: g * DP, mean))
    # The contract's arithmetic (docs/design.md §7: divide by the group size, then sum) bit for bit.
    assert_tree_equal(mean, _run(lambda p, x: _divide_then_psum(local_grad(_loss)(p, x))))


def _divide_then_psum(grads):
    return jax.tree.map(lambda g: lax.psum(g / lax.axis_size("dp"), "dp"), grads)


@pytest.mark.slow
def test_mean_over_a_group_that_is_not_a_power_of_two() -> None:
    """dp = 6 takes the divide-before-sum path; it is the contract's arithmetic exactly."""
    mesh = mesh_from_topology(Topology.create(6), jax.devices()[:6])
    x = X[: 6 * 4]

    def run(body):
        mapped = jax.shard_map(body, mesh=mesh, in_specs=(P(), P("dp")), out_specs=P())
        return jax.jit(mapped)(
            jax.device_put(PARAMS, NamedSharding(mesh, P())),
            jax.device_put(x, NamedSharding(mesh, P("dp"))),
        )

    mean = run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"))
    assert_tree_equal(mean, run(lambda p, x: _divide_then_psum(local_grad(_loss)(p, x))))
    assert_tree_close(mean, jax.grad(_loss)(PARAMS, x))


def test_invariant_gradient_is_refused_not_silently_wrong() -> None:
    """The hazard itself, then the guard that catches it."""
    # jax.grad of a replicated parameter inside shard_map is already psum'ed: pmean is a no-op
    # and the result is DP times the mean (the loss is a per-device mean).
    naive = _run(lambda p, x: lax.pmean(jax.grad(_loss)(p, x), "dp"))
    full_batch = jax.grad(_loss)(PARAMS, X)
    assert_tree_close(naive, jax.tree.map(lambda g: g * DP, full_batch))

    message = "gradient 'layer_0/bias' is already invariant over 'dp'.*count it 8 times"
    with pytest.raises(ValueError, match=message):
        _run(lambda p, x: sync_gradients(jax.grad(_loss)(p, x), "dp"))
    # The documented fix: differentiate w.r.t. make_local(params).
    fixed = _run(lambda p, x: sync_gradients(jax.grad(_loss)(make_local(p, "dp"), x), "dp"))
    assert_tree_close(fixed, full_batch)


@pytest.mark.slow
def test_check_vma_false_and_pmap_give_the_same_gradients() -> None:
    def body(p, x):
        return sync_gradients(local_grad(_loss)(p, x), "dp")

    reference = _run(body)
    # check_vma=False: JAX inserts no psum, gradients are local, the guard cannot apply.
    assert_tree_equal(_run(body, check_vma=False), reference)
    # pmap, both with a replicated (in_axes=None) and a stacked parameter argument.
    shards = X.reshape(DP, -1, X.shape[1])
    pmapped = jax.pmap(body, axis_name="dp", in_axes=(None, 0))(PARAMS, shards)
    assert_tree_equal(jax.tree.map(lambda g: g[3], pmapped), reference)
    stacked = jax.tree.map(lambda a: jnp.stack([a] * DP), PARAMS)
    pmapped = jax.pmap(body, axis_name="dp")(stacked, shards)
    assert_tree_equal(jax.tree.map(lambda g: g[0], pmapped), reference)


@pytest.mark.slow
def test_reduce_dtype_bfloat16_compresses_and_restores_dtype() -> None:
    exact = _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"))
    bf16 = _run(
        lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", reduce_dtype=jnp.bfloat16)
    )
    for a, e in zip(jax.tree.leaves(bf16), jax.tree.leaves(exact), strict=True):
        assert a.dtype == jnp.float32
        # bf16 keeps 8 bits of mantissa: relative error <= 2**-8 per rounding, a few roundings.
        np.testing.assert_allclose(a, e, rtol=0, atol=2**-6 * float(jnp.abs(e).max()))
    assert any(
        not np.array_equal(a, e)
        for a, e in zip(jax.tree.leaves(bf16), jax.tree.leaves(exact), strict=True)
    )


def _compiled(fn, *args) -> str:
    return fn.lower(*args).compile().as_text()


@pytest.mark.slow
def test_bucket_plan_packs_nothing_compiles_to_the_default_all_reduce_and_is_bitwise_equal():
    """A bucket is one ``psum`` of its gradients, not a flat buffer: XLA's all-reduce
    combiner merges the step's all-reduces as it merges the per-leaf default's, so both
    compile to one all-reduce of the same operands, with no ``concatenate`` (packing had
    cost XLA:CPU more than the collective, docs/jax.md)."""
    plan = plan_buckets(param_specs(PARAMS), cap_bytes=600, first_cap_bytes=600)
    assert len(plan.buckets) >= 3

    def per_leaf(p, x):
        return sync_gradients(local_grad(_loss)(p, x), "dp")

    def bucketed(p, x):
        return sync_gradients(local_grad(_loss)(p, x), "dp", plan=plan)

    assert_tree_equal(_run(bucketed), _run(per_leaf))
    args = (
        jax.device_put(PARAMS, NamedSharding(MESH, P())),
        jax.device_put(X, NamedSharding(MESH, P("dp"))),
    )
    reduces = {}
    for name, body in (("leaf", per_leaf), ("bucket", bucketed)):
        fn = jax.jit(jax.shard_map(body, mesh=MESH, in_specs=(P(), P("dp")), out_specs=P()))
        text = _compiled(fn, *args)
        assert "concatenate" not in text
        reduces[name] = re.findall(r"= (\(.*?\)) all-reduce\(", text)
    assert len(reduces["bucket"]) == 1 and reduces["bucket"] == reduces["leaf"]
    assert reduces["bucket"][0].count("f32[") == len(jax.tree.leaves(PARAMS))


@pytest.mark.slow
def test_plan_from_torch_names_via_names_argument() -> None:
    """A plan built from torch names/shapes (torch_specs) drives the sync of a Flax tree."""
    plan = plan_buckets(torch_specs(PARAMS), cap_bytes=600, first_cap_bytes=600)
    assert plan.slots[0].name.endswith(".weight") or plan.slots[0].name.endswith(".bias")

    def bucketed(p, x):
        grads = local_grad(_loss)(p, x)
        return sync_gradients(grads, "dp", plan=plan, names=torch_names(grads))

    assert_tree_equal(
        _run(bucketed), _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"))
    )
    with pytest.raises(ValueError, match="names has 2 entries but grads has 6 leaves"):
        _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", names=["a", "b"]))


def test_multi_axis_group_reduces_over_the_tuple() -> None:
    """Batch sharded over ("dp", "cp") of a dp=4, cp=2 mesh: one mean over 8 shards."""
    mesh = mesh_from_topology(Topology.create(DP, cp=2))
    axes = ("dp", "cp")
    got = _run(
        lambda p, x: sync_gradients(local_grad(_loss, axis_name=axes)(p, x), axes),
        mesh=mesh,
        batch_axes=axes,
    )
    assert_tree_close(got, jax.grad(_loss)(PARAMS, X))
    # Over "dp" alone, a gradient that still varies over "cp" keeps varying: out_specs=P()
    # rejects it (shard_map's ValueError names the axis), so a forgotten axis cannot pass
    # silently.
    with pytest.raises(ValueError, match=r"(?s)out_specs which require replication.*'cp'"):
        _run(
            lambda p, x: sync_gradients(local_grad(_loss, axis_name=axes)(p, x), "dp"),
            mesh=mesh,
            batch_axes=axes,
        )


def test_unused_parameter_takes_part_with_zeros() -> None:
    """A parameter the loss does not use gets a (local, varying) zero gradient and is synced."""
    params = {**PARAMS, "unused": jnp.ones(5)}
    mapped = jax.shard_map(
        lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"),
        mesh=MESH,
        in_specs=(P(), P("dp")),
        out_specs=P(),
    )
    got = jax.jit(mapped)(
        jax.device_put(params, NamedSharding(MESH, P())),
        jax.device_put(X, NamedSharding(MESH, P("dp"))),
    )
    np.testing.assert_array_equal(got["unused"], np.zeros(5, np.float32))
    assert_tree_close({k: v for k, v in got.items() if k != "unused"}, jax.grad(_loss)(PARAMS, X))


def test_bad_input_gets_one_clear_sentence() -> None:
    with pytest.raises(NameError, match="not bound here"):
        sync_gradients(PARAMS, "dp")
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum'"):
        _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", reduce="avg"))
    with pytest.raises(TypeError, match="only floating gradients"):
        _run(lambda p, x: sync_gradients({"n": lax.axis_index("dp")}, "dp"))

    other = plan_buckets(param_specs({"w": PARAMS["layer_0"]["kernel"]}))
    with pytest.raises(ValueError, match="'layer_0/bias' has no slot in the bucket plan"):
        _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", plan=other))
    bigger = plan_buckets(param_specs({**PARAMS, "extra": jnp.zeros(3)}))
    with pytest.raises(ValueError, match="'extra', which is not a leaf of grads"):
        _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", plan=bigger))
    wrong = plan_buckets(
        param_specs({**PARAMS, "layer_0": {**PARAMS["layer_0"], "bias": jnp.zeros(5)}})
    )
    with pytest.raises(ValueError, match="'layer_0/bias' has shape \\(12,\\) but its plan"):
        _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp", plan=wrong))


def test_auto_axis_mesh_works_too() -> None:
    mesh = mesh_from_topology(Topology.create(DP), axis_types=AxisType.Auto)
    got = _run(lambda p, x: sync_gradients(local_grad(_loss)(p, x), "dp"), mesh=mesh)
    assert_tree_close(got, jax.grad(_loss)(PARAMS, X))
