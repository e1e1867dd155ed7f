"""ZeRO-3 on the JAX pipeline equals the unpipelined program (issue 36, item 2).

A ``zero3`` plan keeps every stage's parameters cut over the data-parallel axis (FSDP2's dim-0
cut of each layer, ``pipeline_layout``): the step gathers its rank's stages before the tick
loop, reduce-scatters the summed gradients after it, and steps AdamW on the chunks. On 8 CPU
devices, float32, 4 steps: losses, parameters and both AdamW moments equal the unpipelined
model's with the same microbatch accumulation order (tests/jax/pipeline_problem.py's
reference) within the floor of test_pipeline.py (1e-5 relative); each device holds 1/dp of its
rank's parameters and optimizer state; a ZeRO-3 pipeline's checkpoint continues in the plain
pipeline.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import numpy as np
import optax
import pytest

from gradsync_core import Topology, plan_pipeline
from gradsync_jax import mesh_from_topology, shard_optimizer
from gradsync_jax.pipeline import (
    load_pipeline,
    natural_params,
    pipeline_layout,
    pipeline_params,
    pipeline_step,
    save_pipeline,
)
from tests.jax.pipeline_problem import MODEL, init_params, make_batch, reference
from tests.support.asserts import assert_tree_close, assert_tree_equal
from tests.support.xla import FAST_COMPILE

STEPS = 4
TX = optax.adamw(1e-2, weight_decay=0.1)


def make_plan(
    schedule: str, pp: int, v: int, m: int, *, zero3: bool = True, dp_shard: int | None = None
) -> Any:
    return plan_pipeline(
        schedule=schedule,
        microbatches=m,
        topology=Topology.create(8, pp=pp, dp_shard=dp_shard),
        layers=2 * pp * v,
        stages_per_rank=v,
        input_weight=0,
        output_weight=0,
        zero3=zero3,
    )


def train(plan: Any, steps: int = STEPS) -> dict[str, Any]:
    """``steps`` AdamW steps of a zero3 ``plan`` from ``init_params``."""
    mesh = mesh_from_topology(plan.topology)
    natural = init_params(plan.num_stages * 2)
    layout = pipeline_layout(natural, plan)
    step = pipeline_step(MODEL, TX, mesh, plan, layout=layout)
    params = pipeline_params(natural, plan, mesh)
    state = step.init(params)
    batches = [make_batch(plan.topology.dp, plan.microbatches, seed) for seed in range(steps)]
    compiled = step.lower(params, state, batches[0]).compile(compiler_options=FAST_COMPILE)
    losses = []
    for batch in batches:
        params, state, loss = compiled(params, state, batch)
        losses.append(float(loss))
    return {
        "step": step,
        "params": params,
        "state": state,
        "losses": losses,
        "natural": natural,
        "batches": batches,
        "layout": layout,
    }


def check_against_unpipelined(plan: Any) -> None:
    run = train(plan)
    step, params, state = run["step"], run["params"], run["state"]
    ref_params, ref_state, ref_losses = reference(
        run["natural"], run["batches"], plan, plan.topology.dp, TX
    )
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-6)
    got = natural_params(params, plan, layout=step.layout)
    assert_tree_close(got, ref_params, rtol=1e-5, what="params")
    got_state = step.natural_state(state, params)
    assert_tree_close(got_state[0].mu, ref_state[0].mu, rtol=1e-5, what="mu")
    assert_tree_close(got_state[0].nu, ref_state[0].nu, rtol=1e-5, what="nu")
    assert int(got_state[0].count) == STEPS


def test_zero3_1f1b_equals_unpipelined() -> None:
    """pp 2 x dp 4, 1F1B."""
    check_against_unpipelined(make_plan("1F1B", 2, 1, 4))


# (schedule, pp, stages per rank, microbatches)
CASES = [
    ("GPipe", 2, 1, 4),
    ("GPipe", 4, 1, 8),
    ("1F1B", 4, 1, 8),
    ("ZB1P", 2, 2, 4),
    ("LoopedBFS", 4, 2, 4),
]


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-pp{c[1]}-v{c[2]}-m{c[3]}")
def test_zero3_schedule_equals_unpipelined(case: tuple[str, int, int, int]) -> None:
    check_against_unpipelined(make_plan(*case))


@pytest.mark.slow
def test_hsdp_equals_unpipelined() -> None:
    """pp 2 x dp 4 as 2 replicas of dp_shard 2 (HSDP): cut over ``dp_shard``, the
    reduce-scattered gradients all-reduced over ``dp_replicate``."""
    plan = make_plan("1F1B", 2, 1, 4, dp_shard=2)
    run = train(plan, steps=1)
    leaf = run["params"]["blocks"]["w1"]
    # w1 (8, 16): each layer's 8 torch rows cut over dp_shard 2, the same on both replicas
    assert leaf.sharding.shard_shape(leaf.shape) == (1, 1, 2, 4, 16)
    assert leaf.sharding.spec[:4] == ("pp", None, None, "dp_shard")
    check_against_unpipelined(plan)


def device_bytes(tree: Any) -> int:
    """The bytes of ``tree`` on one device (device 0's shards)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += sum(s.data.nbytes for s in leaf.addressable_shards if s.device.id == 0)
    return total


@pytest.mark.parametrize("pp", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_parameters_and_state_are_cut_over_dp(pp: int) -> None:
    """Each device holds its chunk of its rank's parameters and AdamW moments: the plain
    pipeline's bytes over dp, plus FSDP2's padding (every layer's torch dim 0 rounded up to a
    multiple of dp); the compiled step's arguments shrink the same way."""
    dp = 8 // pp
    natural = init_params(2 * pp)
    plans = {z: make_plan("1F1B", pp, 1, 4, zero3=z) for z in (False, True)}
    mesh = mesh_from_topology(plans[True].topology)
    layout = pipeline_layout(natural, plans[True])
    sizes: dict[bool, dict[str, int]] = {}
    for zero3, plan in plans.items():
        step = pipeline_step(MODEL, TX, mesh, plan, layout=layout if zero3 else None)
        params = pipeline_params(natural, plan, mesh)
        state = step.init(params)
        batch = make_batch(dp, plan.microbatches, 0)
        memory = (
            step.lower(params, state, batch)
            .compile(compiler_options=FAST_COMPILE)
            .memory_analysis()
        )
        sizes[zero3] = {
            "params": device_bytes(params),
            "moments": device_bytes((state[0].mu, state[0].nu)),
            "arguments": memory.argument_size_in_bytes - batch[0].nbytes * 2 // dp,
        }
    # a device's chunks: each leaf's padded rows, for each of its rank's 2 blocks
    padded = sum(
        4 * leaf.padded_rows * math.prod(leaf.torch_shape[1:]) * (2 if "blocks" in leaf.name else 1)
        for leaf in layout.leaves
    )
    plain, cut = sizes[False], sizes[True]
    assert cut["params"] == padded
    assert cut["moments"] == 2 * padded
    assert plain["params"] / dp <= cut["params"] <= 1.25 * plain["params"] / dp
    assert cut["arguments"] <= 1.25 * plain["arguments"] / dp + 64


def test_refuses_what_it_cannot_shard() -> None:
    plan, plain = make_plan("1F1B", 2, 1, 4), make_plan("1F1B", 2, 1, 4, zero3=False)
    mesh = mesh_from_topology(plan.topology)
    natural = init_params(4)
    layout = pipeline_layout(natural, plan)
    with pytest.raises(ValueError, match=r"pass layout=pipeline_layout\(natural, plan\)"):
        pipeline_step(MODEL, TX, mesh, plan)
    with pytest.raises(ValueError, match=r"plan_pipeline\(\.\.\., zero3=True\)"):
        pipeline_step(MODEL, TX, mesh, plain, layout=layout)
    with pytest.raises(ValueError, match="not shard_optimizer"):
        pipeline_step(MODEL, shard_optimizer(TX, mesh), mesh, plan, layout=layout)
    with pytest.raises(ValueError, match="either param_specs or a zero3 plan"):
        specs = jax.tree.map(lambda _: jax.sharding.PartitionSpec(), natural)
        pipeline_step(MODEL, TX, mesh, plan, layout=layout, param_specs=specs)
    with pytest.raises(ValueError, match="planned for 4 devices but the mesh axis 'dp' has 2"):
        other = mesh_from_topology(Topology.create(8, pp=4))
        pipeline_step(MODEL, TX, other, make_plan("1F1B", 4, 1, 4), layout=layout)
    step = pipeline_step(MODEL, TX, mesh, plan, layout=layout)
    whole = pipeline_params(natural, plain, mesh)  # not cut
    with pytest.raises(ValueError, match="not the sharded pipeline layout"):
        step.init(whole)
    params = pipeline_params(natural, plan, mesh)
    with pytest.raises(ValueError, match="needs the layout that cut the parameters"):
        natural_params(params, plan)
    with pytest.raises(ValueError, match="drop layout= or plan with zero3=True"):
        pipeline_params(natural, plain, mesh, layout=layout)
    assert_tree_equal(natural_params(params, plan, layout=layout), natural)


@pytest.mark.slow
def test_checkpoint_continues_in_the_plain_pipeline(tmp_path: Any) -> None:
    """``save_pipeline`` of a ZeRO-3 pipeline at pp 2 x dp 4 (two steps) writes the model-space
    checkpoint; the plain pipeline at pp 4 loads it (parameters and AdamW state bit for bit
    what the ZeRO-3 step held) and back."""
    plan = make_plan("1F1B", 2, 1, 4)
    run = train(plan, steps=2)
    step, params, state = run["step"], run["params"], run["state"]
    save_pipeline(tmp_path / "ckpt", step, params, state, step=2)
    natural = run["natural"]
    plain = plan_pipeline(
        schedule="1F1B",
        microbatches=4,
        topology=Topology.create(8, pp=4),
        layers=4,
        input_weight=0,
        output_weight=0,
    )
    other = pipeline_step(MODEL, TX, mesh_from_topology(plain.topology), plain)
    loaded, loaded_state, manifest = load_pipeline(tmp_path / "ckpt", other, natural)
    assert (manifest.framework, manifest.step) == ("jax", 2)
    assert_tree_equal(
        natural_params(loaded, plain), natural_params(params, plan, layout=step.layout)
    )
    assert_tree_equal(
        other.natural_state(loaded_state, loaded),
        step.natural_state(state, params),
        same_structure=True,
    )
    # and back: the plain pipeline's checkpoint into the ZeRO-3 one
    save_pipeline(tmp_path / "back", other, loaded, loaded_state, step=2)
    again, again_state, _ = load_pipeline(tmp_path / "back", step, natural)
    assert_tree_equal(again, params)
    assert_tree_equal(step.natural_state(again_state, again), step.natural_state(state, params))
