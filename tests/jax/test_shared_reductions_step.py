"""The JAX gradient sync with shared-parameter sums, on 8 CPU devices (dp=2 x tp=2 x cp=2).

``data_parallel_step(..., param_specs=, batch_spec=)`` with ``synced("dp", shared=plan)`` in
its ``tx`` trains the tensor/context parallel NNX model exactly like its serial twin on the
full batch: parameters AND Adam's mu/nu/count after 3 steps, rtol 1e-5 and atol 1e-5 x the
leaf's largest magnitude (float32; only the summation order differs: measured differences are
below 1e-6 relative).
``sync_gradients(..., shared=plan)`` is checked directly (gradients vs the serial ones,
rtol 2e-5, atol 2e-6), with a control that leaves ``shared`` out and so holds partial sums.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import ReductionPlan, Topology, plan_shared_reductions
from gradsync_jax import (
    data_parallel_step,
    local_grad,
    mesh_from_topology,
    nnx_functional,
    path_name,
    shared_param_specs,
    sync_gradients,
    synced,
)
from tests.jax.hlo import collectives_in_loops
from tests.jax.models import MLPTransformer, ParallelMLPTransformer
from tests.support.asserts import assert_tree_close

pytestmark = pytest.mark.slow

TOPO = Topology.create(8, tp=2, cp=2)  # dp=2
MESH = mesh_from_topology(TOPO)
DIM, HIDDEN, DEPTH, BATCH, SEQ = 8, 8, 2, 8, 8
STEPS = 3
RTOL = 1e-5


def _problem():
    rng = np.random.default_rng(0)
    batches = [
        tuple(rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32) for _ in range(2))
        for _ in range(STEPS)
    ]
    apply, params, _ = nnx_functional(MLPTransformer(DIM, HIDDEN, DEPTH, rngs=nnx.Rngs(0)))
    return apply, params, batches


SERIAL_APPLY, PARAMS, BATCHES = _problem()


def _parallel(sp: bool):
    """(loss_fn, param specs, batch spec, plan) of the parallel twin."""
    model = ParallelMLPTransformer(DIM, HIDDEN, DEPTH, sequence_parallel=sp, rngs=nnx.Rngs(1))
    apply, _, specs = nnx_functional(model)
    data = P("dp", ("cp", "tp")) if sp else P("dp", "cp")
    plan = plan_shared_reductions(
        shared_param_specs(PARAMS, specs, data_axes=data, mesh=MESH), TOPO
    )

    def loss_fn(params, batch):  # this device's share of its replica's loss
        x, target = batch
        return ((apply(params, x) - target) ** 2).sum() / (x.shape[0] * SEQ * DIM)

    return loss_fn, specs, data, plan


def _serial(tx):
    @jax.jit
    def step(params, state, batch):
        x, target = batch
        loss, grads = jax.value_and_grad(lambda p: ((SERIAL_APPLY(p, x) - target) ** 2).mean())(
            params
        )
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params, state, losses = PARAMS, tx.init(PARAMS), []
    for batch in BATCHES:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, losses


def _run(step, tx):
    params, state, losses = PARAMS, tx.init(PARAMS), []
    for batch in BATCHES:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, losses


@pytest.mark.parametrize(
    ("sp", "accumulate_steps"),
    [(False, 1), (False, 2), (True, 2)],
    ids=["cp", "cp-accumulate-2", "cp+sequence-parallel-accumulate-2"],
)
def test_step_with_shared_sums_equals_serial_params_and_adam_moments(sp, accumulate_steps):
    loss_fn, specs, data, plan = _parallel(sp)
    assert plan.group_of("norm/scale") == ("tp-cp" if sp else "cp")
    tx = optax.chain(synced("dp", shared=plan), optax.adam(1e-2))
    step = data_parallel_step(
        loss_fn,
        tx,
        MESH,
        param_specs=specs,
        batch_spec=data,
        accumulate_steps=accumulate_steps,
    )
    params, state, losses = _run(step, tx)
    ref_params, ref_state, ref_losses = _serial(optax.adam(1e-2))
    assert_tree_close(params, ref_params, rtol=RTOL)
    assert_tree_close(
        state[1], ref_state, rtol=RTOL
    )  # mu, nu and count: an N-times gradient shows here
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    # The tensor-parallel kernels come back sharded as declared.
    kernel = params["blocks"][0]["fc1"]["kernel"]
    assert kernel.sharding.spec == specs["blocks"][0]["fc1"]["kernel"]


def test_shared_sums_run_once_after_accumulation():
    """With ``shared`` the cp sums leave the micro-step loop; without it JAX sums at every
    use inside it (the same values, by its implicit psum: checked too)."""
    loss_fn, specs, data, plan = _parallel(False)
    with_tx = optax.chain(synced("dp", shared=plan), optax.sgd(0.1))
    without_tx = optax.sgd(0.1)  # the default sync: the dp mean only

    def compiled(tx):
        step = data_parallel_step(
            loss_fn,
            tx,
            MESH,
            param_specs=specs,
            batch_spec=data,
            accumulate_steps=4,  # a scan of 3 (2 would be unrolled: no loop to inspect)
        )
        state = tx.init(PARAMS)
        return jax.jit(step).lower(PARAMS, state, BATCHES[0]).compile(), state

    (with_plan, with_state), (without, without_state) = compiled(with_tx), compiled(without_tx)
    # The remaining in-loop all-reduces are the tp mappings' (XLA combines what it can:
    # measured 4 with the plan vs 5 without).
    in_loops = [collectives_in_loops(c.as_text())[2] for c in (with_plan, without)]
    assert in_loops[0] < in_loops[1], in_loops
    assert_tree_close(
        with_plan(PARAMS, with_state, BATCHES[0])[0],
        without(PARAMS, without_state, BATCHES[0])[0],
        rtol=RTOL,
    )


def _named(tree) -> dict:
    return {path_name(p): v for p, v in jax.tree_util.tree_leaves_with_path(tree)}


@pytest.mark.parametrize("sp", [False, True], ids=["cp", "cp+sequence-parallel"])
def test_sync_gradients_with_shared_equals_serial_and_without_is_partial(sp):
    loss_fn, specs, data, plan = _parallel(sp)
    x, target = BATCHES[0]
    ref = _named(jax.grad(lambda p: ((SERIAL_APPLY(p, x) - target) ** 2).mean())(PARAMS))

    def body(params, x, target):
        grads = local_grad(loss_fn, shared=plan)((params), (x, target))
        unsummed = sync_gradients(grads, "dp")  # the control: no shared sums
        partial = {name: g[None] for name, g in _named(unsummed).items()}
        return sync_gradients(grads, "dp", shared=plan), partial

    # The control's partial gradients vary over their group: stack them along it.
    partial_specs = {
        name: P(TOPO.mesh_axes(plan.group_of(name)) if plan.group_of(name) else None, *s)
        for name, s in _named(specs).items()
    }
    fn = jax.jit(
        jax.shard_map(
            body, mesh=MESH, in_specs=(specs, data, data), out_specs=(specs, partial_specs)
        )
    )
    put = lambda a, s: jax.device_put(a, NamedSharding(MESH, s))  # noqa: E731
    grads, partial = fn(jax.tree.map(put, PARAMS, specs), put(x, data), put(target, data))
    planned = {name for r in plan.reductions for name in r.names}
    assert "norm/scale" in planned and "blocks/0/fc2/bias" in planned
    wrong = set()
    for name, expected in ref.items():
        np.testing.assert_allclose(
            _named(grads)[name], expected, rtol=2e-5, atol=2e-6, err_msg=name
        )
        member = np.asarray(partial[name])[0]
        if not np.allclose(member, expected, rtol=2e-5, atol=2e-6):
            wrong.add(name)
    assert wrong == planned, (wrong, planned)


def test_bad_input_gets_one_clear_sentence():
    loss_fn, _, data, plan = _parallel(False)
    tx = optax.adam(1e-2)
    with pytest.raises(ValueError, match=r"batch_spec must be a PartitionSpec whose first"):
        data_parallel_step(loss_fn, tx, MESH, batch_spec=P("cp", "dp"))
    other = ReductionPlan(topology=Topology.create(8, tp=4), reductions=())
    other_tx = optax.chain(synced("dp", shared=other), tx)
    with pytest.raises(ValueError, match=r"shared reduction plan was made for axes"):
        step = data_parallel_step(loss_fn, other_tx, MESH, batch_spec=data)
        step(PARAMS, other_tx.init(PARAMS), BATCHES[0])
    with pytest.raises(ValueError, match=r"argnums=\(0, 1\) differentiates several"):
        local_grad(loss_fn, argnums=(0, 1), shared=plan)
    step = data_parallel_step(loss_fn, tx, MESH, param_specs={"wrong": P()}, batch_spec=data)
    with pytest.raises(ValueError, match=r"could not derive the optimizer state's"):
        step(PARAMS, tx.init(PARAMS), BATCHES[0])
