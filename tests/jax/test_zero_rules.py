"""Per-parameter rules run under the flat partition, exactly (issue 26 item 2).

A weight-decay mask, ``optax.masked``, ``optax.multi_transform`` by path label and frozen
parameters (``set_to_zero``) decide per parameter. The bucket layout cannot honour them (a
chunk cuts through parameters); the flat partition then plans one bucket per parameter and
runs the inner update on a parameter-shaped tree of element ranges (``FlatLayout.by_param``).
Each case (``rule_cases``) runs 6 steps at 2, 4 and 8 devices under ``auto`` and must match
the unsharded run (parameters and gathered state, rtol 1e-5), in ``test_zero_coupled.py``'s
program (one compilation per device count for both files).
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from gradsync_jax import shard_optimizer
from gradsync_jax.zero.flat import FlatLayout
from gradsync_jax.zero.greedy import GreedyLayout
from tests.jax.sweep_cases import SHAPES, ndim_mask, rule_cases
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import random_params


def test_the_stored_layout_round_trips_through_model_space() -> None:
    # What checkpoints go through; the runs at 2, 4 and 8 devices against the unsharded
    # ones share test_zero_coupled.py's compiled program (rule_cases).
    mesh = mesh_of(4)
    params = random_params(SHAPES)
    inner = rule_cases()["adamw(mask=ndim>1)"]
    tx = shard_optimizer(inner, mesh)
    assert tx.layout(params).by_param
    rng = np.random.default_rng(5)
    state = jax.tree.map(
        lambda x: (
            np.asarray(rng.normal(size=np.shape(x)), np.asarray(x).dtype)
            if np.issubdtype(np.asarray(x).dtype, np.floating)
            else np.asarray(x)
        ),
        inner.init(params),
    )
    assert_tree_close(tx.gather_state(tx.scatter_state(state, params), params), state, rtol=0)


def test_a_rule_element_ranges_cannot_decide_is_refused_by_flat() -> None:
    # A mask by size sees a range's size, not the parameter's: the analysis finds the
    # update differs from the whole tree's, so flat refuses and auto takes greedy.
    mesh = mesh_of(2)
    inner = optax.adamw(1e-2, mask=lambda p: jax.tree.map(lambda x: x.size > 12, p))
    params = random_params(SHAPES)
    assert isinstance(shard_optimizer(inner, mesh).layout(params), GreedyLayout)
    with pytest.raises(ValueError, match="partition='flat' cuts parameters") as err:
        shard_optimizer(inner, mesh, partition="flat").init(params)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("shape", [(10, 1000, 1000), (6, 1001, 1001)], ids=["even", "uneven"])
def test_per_parameter_flat_keeps_flat_balance(shape: tuple[int, int, int]) -> None:
    # Planned on abstract parameters (no arrays): masked AdamW keeps 1/N of the state (+ a
    # parameter's padding to a multiple of N at most), where greedy kept 1.6/N on 10 x 1000^2.
    count, rows, cols = shape
    params = {
        f"layer{i}": {
            "kernel": jax.ShapeDtypeStruct((rows, cols), np.float32),
            "bias": jax.ShapeDtypeStruct((cols,), np.float32),
        }
        for i in range(count)
    }
    mesh = mesh_of(8)
    tx = shard_optimizer(optax.adamw(1e-3, mask=ndim_mask), mesh)
    layout = tx.layout(params)
    assert isinstance(layout, FlatLayout) and layout.by_param
    whole = sum(2 * 4 * (rows * cols + cols) for _ in range(count))  # mu and nu, float32
    assert tx.state_nbytes_per_device(params) <= whole / 8 * 1.05
    # Each kernel has its own reduce-scatter and all-gather; the biases (a few KiB each)
    # share one of each (FlatLayout.wire_groups), the stored ranges staying per parameter.
    assert sorted(len(group) for group in layout.wire_groups()) == [1] * count + [count]


def test_auto_packs_nothing_and_explicit_flat_keeps_torch_buckets() -> None:
    # auto: one bucket per parameter (no per-step packing; docs/jax-zero.md, "Performance");
    # explicit flat: the torch-style buckets (ZeroRedundancyOptimizer's plan) where it can.
    params = {
        "w": jax.ShapeDtypeStruct((64, 64), np.float32),
        "b": jax.ShapeDtypeStruct((64,), np.float32),
    }
    mesh = mesh_of(8)
    auto = shard_optimizer(optax.adam(1e-3), mesh).layout(params)
    flat = shard_optimizer(optax.adam(1e-3), mesh, partition="flat").layout(params)
    assert isinstance(auto, FlatLayout) and auto.by_param and len(auto.buckets.buckets) == 2
    assert isinstance(flat, FlatLayout) and not flat.by_param and len(flat.buckets.buckets) == 1
