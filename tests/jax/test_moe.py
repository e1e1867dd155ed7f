"""The JAX mixture-of-experts block under data_parallel_step matches the serial model.

8 CPU devices, ``Topology.create(8, ep=2)``: dense dp = 8, ep = 2, edp = 4, on the expert
mesh (``mesh_from_topology(topo, expert=True)``, axes pp, edp, ep, etp). The model is a dense
projection then ``MoE`` (a router and 4 experts, 2 per device). Its outputs inside
``shard_map`` equal the serial block's on the full batch, and two Adam steps equal the
serial ones: parameters, mu (0.1 x every gradient after step one), nu and the loss, float32
rtol 1e-5 (only the summation order differs). A control planned without expert parameters
(so they get the dense mean over edp and ep) is wrong on exactly the expert weights.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_shared_reductions
from gradsync_jax import (
    data_parallel_step,
    mesh_from_topology,
    nnx_functional,
    shared_param_specs,
    synced,
)
from gradsync_jax.model_parallel.experts import MoE
from tests.support.asserts import assert_tree_close

TOPO = Topology.create(8, ep=2)
MESH = mesh_from_topology(TOPO, expert=True)
DATA = P(("edp", "ep"))
DIM, HIDDEN, EXPERTS, BATCH, SEQ, STEPS = 6, 10, 4, 16, 3, 2
RTOL = 1e-5


class MoEModel(nnx.Module):
    def __init__(self, axis: str | None, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(DIM, DIM, rngs=rngs)
        self.moe = MoE(DIM, HIDDEN, EXPERTS, axis=axis, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = self.proj(x)
        return h + self.moe(h)


SERIAL_APPLY, PARAMS, _ = nnx_functional(MoEModel(None, nnx.Rngs(0)))
APPLY, _, SPECS = nnx_functional(MoEModel("ep", nnx.Rngs(0)))
_rng = np.random.default_rng(0)
BATCHES = [
    tuple(_rng.standard_normal((BATCH, SEQ, DIM)).astype(np.float32) for _ in range(2))
    for _ in range(STEPS)
]


def _loss(apply, params, batch):  # the mean over the tokens given
    x, target = batch
    return ((apply(params, x) - target) ** 2).sum() / (x.shape[0] * SEQ)


def _serial(tx, batches=BATCHES):
    @jax.jit
    def step(params, state, batch):
        loss, grads = jax.value_and_grad(lambda p: _loss(SERIAL_APPLY, p, batch))(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    params, state, losses = PARAMS, tx.init(PARAMS), []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state, losses


def _parallel(tx, plan, batches=BATCHES):
    """Train with ``tx`` after ``synced(("edp", "ep"), shared=plan)``; the state returned is
    ``tx``'s own."""
    chained = optax.chain(synced(("edp", "ep"), shared=plan), tx)
    step = data_parallel_step(
        lambda p, b: _loss(APPLY, p, b),
        chained,
        MESH,
        axis_name=("edp", "ep"),
        param_specs=SPECS,
        batch_spec=DATA,
    )
    params, state, losses = PARAMS, chained.init(PARAMS), []
    for batch in batches:
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    return params, state[1], losses


def _plan():
    specs = shared_param_specs(PARAMS, SPECS, data_axes=DATA, mesh=MESH)
    return specs, plan_shared_reductions(specs, TOPO)


def test_expert_parameters_are_declared_by_their_partition_spec():
    specs, plan = _plan()
    assert [s.name for s in specs if s.expert] == ["moe/w_in", "moe/w_out"]
    assert plan.group_names == ("edp",)
    assert plan.reduction("edp").divisor == TOPO.dp == 8
    assert set(plan.reduction("edp").names) == {"moe/w_in", "moe/w_out"}


@pytest.mark.slow
def test_moe_outputs_match_serial():
    x = BATCHES[0][0]
    mapped = jax.jit(jax.shard_map(APPLY, mesh=MESH, in_specs=(SPECS, DATA), out_specs=DATA))
    place = lambda tree, specs: jax.device_put(  # noqa: E731
        tree, jax.tree.map(lambda s: NamedSharding(MESH, s), specs)
    )
    out = mapped(place(PARAMS, SPECS), jax.device_put(x, NamedSharding(MESH, DATA)))
    np.testing.assert_allclose(out, SERIAL_APPLY(PARAMS, x), rtol=RTOL, atol=1e-6)


@pytest.mark.slow
def test_moe_step_matches_serial_params_and_adam_moments():
    _, plan = _plan()
    tx = optax.adam(1e-2)
    params, state, losses = _parallel(tx, plan)
    ref_params, ref_state, ref_losses = _serial(tx)
    assert_tree_close(params, ref_params, rtol=RTOL)
    assert_tree_close(state, ref_state, rtol=RTOL)  # mu holds every gradient
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert params["moe"]["w_in"].sharding.spec == SPECS["moe"]["w_in"]

    # Control: the experts planned as dense parameters get the dp mean over edp AND ep,
    # which mixes different experts: after one step exactly the expert weights are wrong.
    specs, _ = _plan()
    dense_plan = plan_shared_reductions([replace(s, expert=False) for s in specs], TOPO)
    tx = optax.sgd(1.0)
    control, _, _ = _parallel(tx, dense_plan if dense_plan.reductions else None, BATCHES[:1])
    reference, _, _ = _serial(tx, BATCHES[:1])
    wrong = {
        "/".join(str(k.key) for k in path)
        for path, a in jax.tree_util.tree_leaves_with_path(control)
        if not np.allclose(a, _leaf(reference, path), rtol=RTOL, atol=1e-6)
    }
    assert wrong == {"moe/w_in", "moe/w_out"}


def _leaf(tree, path):
    for key in path:
        tree = tree[key.key]
    return tree


def test_expert_plan_refusals():
    _, plan = _plan()

    def build(mesh, axes):  # the refusals come at the first call, where tx's sync is found
        tx = optax.chain(synced(axes, shared=plan), optax.sgd(0.1))
        step = data_parallel_step(
            lambda p, b: _loss(APPLY, p, b),
            tx,
            mesh,
            axis_name=axes,
            param_specs=SPECS,
            batch_spec=P(axes),
        )
        step(PARAMS, tx.init(PARAMS), BATCHES[0])

    with pytest.raises(ValueError, match=r"group 'edp', which lives on the expert mesh"):
        build(mesh_from_topology(TOPO), "dp")
    with pytest.raises(ValueError, match=r"divided by the dense dp \(8\).* of size 4"):
        build(MESH, "edp")
