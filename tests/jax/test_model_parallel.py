"""JAX mappings and the NNX reference model on 8 CPU devices (dp=2 x tp=2 x cp=2).

Mappings are checked forward and backward (``jax.vjp`` with cotangents of the output's
type) against their definitions with integer-valued float32 data, so sums are exact and
equality is bitwise. The model is checked against its serial twin (float32, rtol 2e-5).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_shared_reductions, split_shapes
from gradsync_jax import (
    all_gather_from,
    copy_to,
    gather_from,
    group_axes,
    make_local,
    make_shared_local,
    mesh_from_topology,
    nnx_functional,
    path_name,
    reduce_from,
    reduce_scatter_to,
    reduce_shared_gradients,
    scatter_to,
    shared_param_specs,
)
from tests.jax.models import MLPTransformer, ParallelMLPTransformer

TOPO = Topology.create(8, tp=2, cp=2)  # dp=2; mesh axes (pp, dp, ep, cp, tp)
MESH = mesh_from_topology(TOPO)


def _put(x, spec):
    return jax.device_put(x, NamedSharding(MESH, spec))


def _ints(seed: int, *shape: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-8, 9, shape).astype(np.float32)


def _padded_chunks(x: np.ndarray, sizes: tuple[int, ...], dim: int) -> np.ndarray:
    """Stack of the ``split_shapes`` chunks along ``dim``, each zero-padded to the largest."""
    width, out, start = max(sizes), [], 0
    for s in sizes:
        chunk = np.take(x, np.arange(start, start + s), axis=dim)
        pad = [(0, 0)] * x.ndim
        pad[dim] = (0, width - s)
        out.append(np.pad(chunk, pad))
        start += s
    return np.stack(out)


def _valid(chunks: np.ndarray, sizes: tuple[int, ...], dim: int) -> np.ndarray:
    """Concatenate the real parts of padded chunks (``dim`` counted without the stack axis)."""
    return np.concatenate(
        [np.take(c, np.arange(s), axis=dim) for c, s in zip(chunks, sizes, strict=True)], dim
    )


@pytest.mark.parametrize("group", ["tp", "tp-cp"])
@pytest.mark.parametrize(
    "full",
    [
        pytest.param(8, id="even"),
        pytest.param(9, id="uneven-ceil", marks=pytest.mark.slow),
        pytest.param(5, id="uneven-floor", marks=pytest.mark.slow),
    ],
)
def test_mappings_forward_and_backward_match_their_definitions(group: str, full: int) -> None:
    axes = TOPO.mesh_axes(group)
    n = TOPO.group_size(group)
    sizes = split_shapes(full, n)
    X = _ints(full, n, 2, full, 3)  # device q's full tensor
    G = _ints(full + 1, n, 2, full, 3)  # device q's full cotangent
    g = _ints(full + 2, n, 2, max(sizes), 3)  # device q's chunk cotangent, padding included
    x0, ginv = X[0], G[0]  # replicated input / invariant cotangent
    xc = np.stack([_padded_chunks(X[q], sizes, 1)[q] for q in range(n)])  # q's chunk of X[q]
    x0c = _padded_chunks(x0, sizes, 1)

    def body(x0, ginv, X, G, g, xc, x0c):
        X, G, g, xc, x0c = X[0], G[0], g[0], xc[0], x0c[0]
        cases = {
            "copy_to": (lambda x: copy_to(x, group), x0, G),
            "reduce_from": (lambda x: reduce_from(x, group), X, ginv),
            "scatter_to": (lambda x: scatter_to(x, group, dim=1), x0, g),
            "gather_from": (lambda x: gather_from(x, group, dim=1, size=full), x0c, ginv),
            "reduce_scatter_to": (lambda x: reduce_scatter_to(x, group, dim=1), X, g),
            "all_gather_from": (lambda x: all_gather_from(x, group, dim=1, size=full), xc, G),
        }
        out = {}
        for name, (fn, x, ct) in cases.items():
            y, vjp = jax.vjp(fn, x)
            (gx,) = vjp(ct)
            out[name] = (y[None], gx[None])
        return out

    stacked = P(axes)
    fn = jax.jit(
        jax.shard_map(
            body,
            mesh=MESH,
            in_specs=(P(), P(), stacked, stacked, stacked, stacked, stacked),
            out_specs=stacked,
        )
    )
    args = [(x0, P()), (ginv, P()), (X, stacked), (G, stacked), (g, stacked), (xc, stacked)]
    out = fn(*[_put(a, s) for a, s in args], _put(x0c, stacked))
    out = jax.tree.map(np.asarray, out)

    def every(a: np.ndarray) -> np.ndarray:  # the same value on every member
        return np.stack([a] * n)

    expected = {
        "copy_to": (every(x0), every(G.sum(0))),
        "reduce_from": (every(X.sum(0)), every(ginv)),
        "scatter_to": (_padded_chunks(x0, sizes, 1), every(_valid(g, sizes, 1))),
        "gather_from": (every(x0), _padded_chunks(ginv, sizes, 1)),
        "reduce_scatter_to": (_padded_chunks(X.sum(0), sizes, 1), every(_valid(g, sizes, 1))),
        "all_gather_from": (every(_valid(xc, sizes, 1)), _padded_chunks(G.sum(0), sizes, 1)),
    }
    for name, (y, gx) in expected.items():
        np.testing.assert_array_equal(out[name][0], y, err_msg=f"{name} forward")
        np.testing.assert_array_equal(out[name][1], gx, err_msg=f"{name} backward")


def test_mapping_misuse_is_a_clear_error() -> None:
    def twice(x):
        return copy_to(copy_to(x, "tp"), "tp")

    f = jax.shard_map(twice, mesh=MESH, in_specs=P(), out_specs=P("tp"))
    with pytest.raises(ValueError, match="copy_to: x already varies over"):
        f(_put(np.zeros(4, np.float32), P()))

    def wrong_size(x):
        return gather_from(x, "tp", size=9)  # chunks of 9 over 2 are padded to 5, not 4

    f = jax.shard_map(wrong_size, mesh=MESH, in_specs=P("tp"), out_specs=P())
    with pytest.raises(ValueError, match=r"\(5, 4\), stored padded to 5"):
        f(_put(np.zeros(8, np.float32), P("tp")))

    def unknown(x):
        return reduce_from(x, "sp")

    f = jax.shard_map(unknown, mesh=MESH, in_specs=P(), out_specs=P())
    with pytest.raises(ValueError, match="not in the mesh axes"):
        f(_put(np.zeros(4, np.float32), P()))

    def singleton(x):  # ep has size 1: every mapping is the identity
        return all_gather_from(scatter_to(copy_to(x, "ep"), "ep"), "ep")

    f = jax.shard_map(singleton, mesh=MESH, in_specs=P(), out_specs=P())
    np.testing.assert_array_equal(f(_put(np.arange(4.0, dtype=np.float32), P())), np.arange(4.0))

    seen = []

    def resolve(x):
        seen.append(group_axes("tp-cp"))
        return x

    jax.shard_map(resolve, mesh=MESH, in_specs=P(), out_specs=P())(_put(np.zeros(2), P()))
    assert seen == [("cp", "tp")]  # group name -> mesh order


DIM, HIDDEN, DEPTH, BATCH, SEQ = 8, 8, 2, 4, 8


def _serial_reference(x: np.ndarray, target: np.ndarray):
    serial = MLPTransformer(DIM, HIDDEN, DEPTH, rngs=nnx.Rngs(0))
    apply, params, _ = nnx_functional(serial)

    def loss(p):
        y = apply(p, x)
        return ((y - target) ** 2).sum() / (BATCH * SEQ), y

    (_, y), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params)
    return params, y, grads


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["cp", "cp+sequence-parallel"])
def test_parallel_model_matches_serial_and_needs_the_derived_sums(sp: bool) -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    target = rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32)
    serial_params, y_ref, g_ref = _serial_reference(x, target)

    model = ParallelMLPTransformer(DIM, HIDDEN, DEPTH, sequence_parallel=sp, rngs=nnx.Rngs(1))
    apply, params, specs = nnx_functional(model)
    assert jax.tree.structure(params) == jax.tree.structure(serial_params)
    params = serial_params  # the same tree: the parallel model IS the serial one, sharded
    data = P("dp", ("cp", "tp")) if sp else P("dp", "cp")
    plan = plan_shared_reductions(
        shared_param_specs(params, specs, data_axes=data, mesh=MESH), TOPO
    )
    assert plan.group_names == (("cp", "tp-cp") if sp else ("cp",))
    assert plan.group_of("norm/scale") == ("tp-cp" if sp else "cp")
    assert plan.group_of("blocks/1/fc2/bias") == ("tp-cp" if sp else "cp")
    local_batch = BATCH // TOPO.dp

    def step(params, x, target):
        local = make_shared_local(make_local(params, "dp"), plan)

        def loss(p):
            y = apply(p, x)  # this device's share of its replica's loss:
            return ((y - target) ** 2).sum() / (local_batch * SEQ), y

        (_, y), grads = jax.value_and_grad(loss, has_aux=True)(local)
        raw = lax.pmean(grads, "dp")  # the data-parallel mean (sync_gradients' job)
        summed = reduce_shared_gradients(raw, plan)
        # Stack the partial (unsummed) gradients along their group to inspect them.
        partial = {name: v[None] for name, v in _named(raw).items()}
        return y, summed, partial

    partial_specs = {
        name: P(plan.topology.mesh_axes(plan.group_of(name)) if plan.group_of(name) else None, *s)
        for name, s in _named(specs).items()
    }
    fn = jax.jit(
        jax.shard_map(
            step,
            mesh=MESH,
            in_specs=(specs, data, data),
            out_specs=(data, specs, partial_specs),
        )
    )
    placed = jax.tree.map(lambda a, s: _put(a, s), params, specs)
    y, grads, partial = fn(placed, _put(x, data), _put(target, data))

    np.testing.assert_allclose(y, y_ref, rtol=2e-5, atol=2e-6)
    for name, ref in _named(g_ref).items():
        got = _named(grads)[name]
        np.testing.assert_allclose(got, ref, rtol=2e-5, atol=2e-6, err_msg=name)
        # Without the derived sum, exactly the planned parameters would be wrong.
        alone = np.asarray(partial[name])[0]
        wrong = not np.allclose(alone, ref, rtol=2e-5, atol=2e-6)
        assert wrong == (plan.group_of(name) is not None), name
        np.testing.assert_allclose(np.asarray(partial[name]).sum(0), ref, rtol=2e-5, atol=2e-6)


def _named(tree) -> dict:
    return {path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


def test_already_summed_gradients_are_refused() -> None:
    """Params replicated over cp but not made local: JAX sums them, a psum would double."""
    model = ParallelMLPTransformer(DIM, HIDDEN, 1, rngs=nnx.Rngs(0))
    apply, params, specs = nnx_functional(model)
    data = P("dp", "cp")
    plan = plan_shared_reductions(
        shared_param_specs(params, specs, data_axes=data, mesh=MESH), TOPO
    )

    def step(params, x):
        grads = jax.grad(lambda p: apply(p, x).sum())(make_local(params, "dp"))
        return reduce_shared_gradients(lax.pmean(grads, "dp"), plan)

    # jit: the refusal happens while tracing, before anything is compiled or run.
    fn = jax.jit(jax.shard_map(step, mesh=MESH, in_specs=(specs, data), out_specs=specs))
    x = np.ones((BATCH, SEQ, DIM), np.float32)
    with pytest.raises(ValueError, match=r"already invariant over .*make_shared_local"):
        fn(jax.tree.map(lambda a, s: _put(a, s), params, specs), _put(x, data))
