"""The whole-tree analysis ``shard_optimizer`` plans with is cached, and never stale.

``soundness.analysed`` keeps the last analyses by the very transformation object (held, so its
id is never reused) and by everything else the analysis reads: the parameter tree's structure,
shapes and dtypes, the probed extra arguments and the message suffix. A transformation rebuilt
equal (``optax.adam(1e-2)`` twice) is another key; the cache stays bounded.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

from gradsync_core import Topology
from gradsync_jax import mesh_from_topology, shard_optimizer
from gradsync_jax.zero import soundness
from gradsync_jax.zero.model_space import model_space

F32 = np.float32


def _tree(shape: tuple[int, ...]) -> dict:
    return {"w": jax.ShapeDtypeStruct(shape, F32), "b": jax.ShapeDtypeStruct((3,), F32)}


def _analysed(given, params, probe=None, where=""):
    inner = optax.with_extra_args_support(given)  # a new wrapper each time, as shard_optimizer
    space = model_space(inner, params)
    return soundness.analysed(given, inner, space, params, probe or {}, where=where)


def test_one_analysis_per_optimizer_and_tree() -> None:
    tx, params = optax.adam(1e-2), _tree((4, 2))
    first = _analysed(tx, params)
    assert first is not None and _analysed(tx, params) is first
    # Everything the analysis reads is in the key.
    assert _analysed(optax.adam(1e-2), params) is not first  # rebuilt equal: not the same
    assert _analysed(tx, _tree((4, 5))) is not first  # another shape
    assert _analysed(tx, {"w": params["w"]}) is not first  # another structure
    value = {"value": jax.ShapeDtypeStruct((), F32)}
    assert _analysed(tx, params, value) is not first  # another probe
    assert _analysed(tx, params, where=" (on a sample tree)") is not first
    assert _analysed(tx, params, where=" (on a sample tree)").where == " (on a sample tree)"


def test_an_update_that_cannot_be_traced_is_cached_as_none() -> None:
    tx = optax.polyak_sgd()  # needs value=: not traceable without it
    params = _tree((2, 2))
    assert _analysed(tx, params) is None and _analysed(tx, params) is None
    assert _analysed(tx, params, {"value": jax.ShapeDtypeStruct((), F32)}) is not None


def test_the_cache_is_bounded() -> None:
    params = _tree((3, 3))
    for _ in range(soundness._CAPACITY + 5):
        _analysed(optax.sgd(1e-2), params)
    assert len(soundness._ANALYSES) <= soundness._CAPACITY


def test_partitions_of_one_optimizer_share_its_analysis_and_plan_as_before() -> None:
    mesh = mesh_from_topology(Topology.create(4), devices=jax.devices()[:4])
    params = {"a": np.zeros((4, 6), F32), "b": np.zeros((10,), F32)}
    tx = optax.lamb(1e-2)  # not elementwise: flat refused, greedy exact, auto greedy
    greedy = shard_optimizer(tx, mesh, partition="greedy").layout(params)
    auto = shard_optimizer(tx, mesh, partition="auto").layout(params)
    assert type(greedy).__name__ == type(auto).__name__ == "GreedyLayout"
    assert greedy.owner == auto.owner
    try:
        shard_optimizer(tx, mesh, partition="flat").layout(params)
    except ValueError as err:
        assert "elementwise" in str(err), err
    else:
        raise AssertionError("lamb under partition='flat' must be refused")
