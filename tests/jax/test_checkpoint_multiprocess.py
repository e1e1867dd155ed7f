"""Checkpoints of 2 JAX processes x 2 CPU devices (jax.distributed on 127.0.0.1): each process
writes its own devices' rank files, process 0 the manifest; the result loads bitwise on 2 x 2
with the other partition, and here on 1 x 4 and 1 x 8; a write failing on one process fails
the save on both and keeps the previous checkpoint; ZeRO-3 and HSDP (one replica per process)
saves load back bitwise and on 1 x 8 (tests/jax/checkpoint_multiprocess_worker.py).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from gradsync_jax import load_optimizer_state, load_params, shard_optimizer
from tests.jax import checkpoint_multiprocess_worker as worker
from tests.jax.distributed_start import launch
from tests.jax.zero_checkpoint_problem import inner, params0, reference
from tests.support.meshes import mesh_of

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    out = tmp_path_factory.mktemp("multiprocess")
    launch(worker.__file__, out)
    return out, dict(np.load(out / "result.npz"))


def test_every_process_agreed(saved) -> None:
    out, result = saved
    same, kept, clean, failed = result["flags"].T  # one row per process
    assert same.all(), "the 2 x 2 greedy save did not load bitwise into the flat partition"
    assert failed.all() and kept.all() and clean.all()
    # Both processes raise the same CheckpointError naming process 1; on process 1 the
    # OSError of its writer is the cause.
    failures = {p: (out / f"failure_{p}.txt").read_text() for p in (0, 1)}
    assert failures[1].startswith("CheckpointError (cause OSError): "), failures[1]
    assert failures[0].startswith("CheckpointError (cause None): "), failures[0]
    for text in failures.values():
        assert "(process 1): process 1 could not write its file: OSError" in text, text
    assert int(result["loaded_world_size"]) == 4


@pytest.mark.parametrize(
    ("name", "devices", "partition"),
    [("greedy", 4, "flat"), ("greedy", 8, "greedy"), ("flat", 8, "greedy")],
)
def test_loads_on_one_process(saved, name: str, devices: int, partition: str) -> None:
    out, result = saved
    params = jax.tree.map(np.asarray, params0())  # only shapes and dtypes are used
    tx = shard_optimizer(inner(), mesh_of(devices), partition=partition)
    state, manifest = load_optimizer_state(out / name, tx, params)
    assert (manifest.world_size, manifest.step) == (4, worker.STEPS)
    leaves = jax.tree.leaves(tx.gather_state(state, params))
    assert len(leaves) == sum(k.startswith("state_") for k in result)
    for i, leaf in enumerate(leaves):
        np.testing.assert_array_equal(leaf, result[f"state_{i}"], err_msg=f"state leaf {i}")
    # And the state is the training's: the unsharded optimizer's within float32 rounding.
    for leaf, ref in zip(leaves, jax.tree.leaves(reference(worker.STEPS)[1]), strict=True):
        np.testing.assert_allclose(leaf, ref, rtol=1e-5, atol=1e-6)


def test_weights_load_on_one_process(saved) -> None:
    out, result = saved
    weights = jax.tree.leaves(load_params(out / "greedy", params0()))
    for i, weight in enumerate(weights):
        np.testing.assert_array_equal(weight, result[f"params_{i}"])


@pytest.mark.parametrize("name", ["zero3", "hsdp"])
def test_zero3_saved_by_two_processes_loads_on_one(saved, name: str) -> None:
    """ZeRO-3 on 2 x 2, and HSDP on a 2 x 2 (replica x shard) mesh with one replica per
    process: loaded back there bitwise; here on 1 x 8, the same parameters and state (padded
    to 8 chunks), and the training's: the single-device run within the floor."""
    from gradsync_jax import param_layout, unshard_params, zero3_step
    from gradsync_jax.checkpoint.param_shards import load_param_shards
    from tests.jax import zero3_problem as model
    from tests.support.asserts import assert_close
    from tests.support.meshes import dp_mesh

    out, result = saved
    assert bool(result[f"{name}_same"]), f"the 2 x 2 {name} save did not load back bitwise"
    replicas = 2 if name == "hsdp" else 1
    # Each rank file has one writer: with HSDP both processes hold shards 0 and 1 (one
    # replica each), and the process of each shard's first device (process 0) writes it.
    writers = result[f"{name}_writers"].astype(int)
    want_writers = [[1, 1], [0, 0]] if name == "hsdp" else [[1, 1, 0, 0], [0, 0, 1, 1]]
    np.testing.assert_array_equal(writers, want_writers)
    layout4 = param_layout(
        model.init_params(),
        world_size=4,
        units=model.UNITS,
        frozen=["frozen"],
        dp_shard=4 // replicas,
    )
    layout8 = param_layout(model.init_params(), world_size=8, units=model.UNITS, frozen=["frozen"])
    step = zero3_step(model.loss_fn, model.adamw(), dp_mesh(8), layout8)
    params, state, manifest = load_param_shards(out / name, step)
    assert (manifest.world_size, manifest.step) == (4 // replicas, worker.ZERO3_STEPS)
    n = len(layout4.leaves)
    saved_params = [result[f"{name}_{i}"] for i in range(n)]
    treedef = jax.tree.structure(model.init_params())
    want = unshard_params(jax.tree.unflatten(treedef, saved_params), layout4)
    got = unshard_params(params, layout8)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(a, b)
    reference_params, reference_state = model.reference(
        model.adamw(), model.init_params(), steps=worker.ZERO3_STEPS
    )
    assert_close(got, reference_params, model.RTOL["params"], "params")
    for moment in ("mu", "nu"):
        whole = model.without_frozen(unshard_params(getattr(state[0], moment), layout8))
        assert_close(whole, getattr(reference_state[0], moment), model.RTOL["state"], moment)
