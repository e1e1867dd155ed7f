"""A ZeRO-3 checkpoint (gradsync_jax.save_param_shards) continues at another device count.

The model of zero3_problem.py (a tied embedding of 6 rows, a frozen layer of 3 rows,
layers of 11 and 5 rows: every dim-0 case the plan cuts) trains 4 AdamW steps on 8 devices,
is saved, loaded on 4 devices and trains 4 more; parameters and both moments must equal the
uninterrupted single-device run of 8 steps within the same-framework floor
(zero3_problem.py's RTOL). The files must be the format's dim-0 element ranges: the
rows of each device, torch names, the weights whole.
"""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from gradsync_core import read_manifest
from gradsync_jax import param_layout, shard_params, unshard_params, zero3_step
from gradsync_jax.checkpoint.param_shards import load_param_shards, save_param_shards
from tests.jax.zero3_problem import (
    FROZEN,
    RTOL,
    STEPS,
    UNITS,
    adamw,
    data,
    init_params,
    loss_fn,
    reference,
    without_frozen,
)
from tests.support.asserts import assert_close
from tests.support.meshes import dp_mesh as mesh_of  # this file's name for it


def zero3(n: int):
    layout = param_layout(init_params(), world_size=n, units=UNITS, frozen=FROZEN)
    return zero3_step(loss_fn, adamw(), mesh_of(n), layout)


def run(step, params, opt_state, steps: int):
    batch = data()
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, batch)
    return params, opt_state


@pytest.mark.slow
def test_save_on_8_continues_on_4(tmp_path) -> None:
    eight = zero3(8)
    params = shard_params(init_params(), eight.mesh, eight.layout)
    params, opt_state = run(eight, params, eight.init(params), STEPS // 2)
    path = str(tmp_path / "ckpt")
    manifest = save_param_shards(path, eight, params, opt_state, step=STEPS // 2)

    # The format: flat element ranges that are each device's rows, torch names and layouts.
    assert manifest.extra["partition"] == "param_shards"
    shards = {(s.name, s.rank): (s.start, s.stop) for s in manifest.plan.shards}
    assert shards[("layers_0.weight", 5)] == (10 * 3, 11 * 3)  # rows [10, 11) of (11, 3)
    assert ("layers_0.weight", 6) not in shards  # past the end: nothing held, nothing stored
    assert manifest.plan.kind == "dim0"  # torch's save_param_shards writes the same
    assert "frozen.weight" not in {s.name for s in manifest.plan.shards}
    assert manifest.extra["scalars"]["embed.weight/step"] == STEPS // 2
    saved_plan = manifest.extra["param_shard_plan"]
    assert saved_plan == json.loads(json.dumps(eight.layout.plan.to_json()))
    assert sorted(os.listdir(os.path.realpath(path)))[-1] == "rank-00007-of-00008.safetensors"

    four = zero3(4)
    loaded, state, _ = load_param_shards(path, four)
    assert loaded["params"]["layers_0"]["kernel"].shape == (12, 3)  # 4 x 3 rows, torch layout
    got_params, got_state = run(four, loaded, state, STEPS - STEPS // 2)
    want_params, want_state = reference(adamw(), init_params())
    assert_close(unshard_params(got_params, four.layout), want_params, RTOL["params"], "params")
    adam = got_state[0]
    assert int(adam.count) == STEPS
    for moment in ("mu", "nu"):
        got = without_frozen(unshard_params(getattr(adam, moment), four.layout))
        assert_close(got, getattr(want_state[0], moment), RTOL["state"], moment)


@pytest.mark.slow
def test_a_checkpoint_without_weights_is_refused(tmp_path) -> None:
    """ZeRO-3 needs the weights: a ZeRO-1 save without ``model=`` names what is missing."""
    from gradsync_jax import save_optimizer_state, shard_optimizer

    params = without_frozen(init_params())
    tx = shard_optimizer(adamw(), mesh_of(2))
    save_optimizer_state(str(tmp_path / "c"), tx, tx.init(params), params, step=0)
    assert read_manifest(str(tmp_path / "c")).extra.get("model") is None
    with pytest.raises(ValueError, match="weight"):
        load_param_shards(str(tmp_path / "c"), zero3(2))


def test_layout_keeps_the_renames() -> None:
    layout = param_layout(init_params(), world_size=2, modules={"layers_0": "blocks.0"})
    assert layout.modules == {"layers_0": "blocks.0"}
    assert "blocks.0.weight" in {leaf.name for leaf in layout.leaves}
    assert jax.tree.structure(init_params()) == layout.treedef
    assert np.all([leaf.padded_rows >= 1 for leaf in layout.leaves])


def _forge(source: str, target: str, key: str, value: float, rows: slice) -> int:
    """A copy of checkpoint ``source`` with ``rows`` of tensor ``key`` set to ``value`` in
    every rank file (the flattened elements of those rows of a dim-0 slice or a whole weight),
    hashes and checksum redone; the number of elements changed."""
    import dataclasses
    import shutil

    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    from gradsync_core.checkpoint import resolve_checkpoint, sha256_file, write_manifest

    shutil.copytree(resolve_checkpoint(source), target)
    manifest = read_manifest(target)
    files, changed = dict(manifest.files), 0
    for name in files:
        path = os.path.join(target, name)
        with safe_open(path, "np") as f:
            metadata = f.metadata()
        tensors = load_file(path)
        if key in tensors:
            flat = tensors[key].reshape(-1)
            part = flat[rows]
            changed += part.size
            flat[rows] = value
            save_file(tensors, path, metadata=metadata)
            files[name] = sha256_file(path)
    write_manifest(target, dataclasses.replace(manifest, files=files))
    return changed


def test_nonfinite_values_read_in_rows_are_refused(tmp_path) -> None:
    """NaN in the state and inf in a weight, spread over rank files: each device's rows are
    read and checked apart, and the count is the tensor's, as a whole read gave it."""
    eight = zero3(8)
    params = shard_params(init_params(), eight.mesh, eight.layout)
    source = str(tmp_path / "ckpt")
    save_param_shards(source, eight, params, eight.init(params), step=0)
    nan = str(tmp_path / "nan")
    # layers_0.weight is (11, 3): ranks 0-4 hold 2 rows each, rank 5 one; elements 1-5 of
    # each slice: 5 in each of ranks 0-4, 2 in rank 5.
    assert _forge(source, nan, "layers_0.weight/exp_avg", np.nan, slice(1, 6)) == 27
    four = zero3(4)
    with pytest.raises(ValueError, match=r"'layers_0\.weight/exp_avg' holds 27 NaN or infinite"):
        load_param_shards(nan, four)
    _, state, _ = load_param_shards(nan, four, allow_nonfinite=True)
    mu = unshard_params(state[0].mu, four.layout)["params"]["layers_0"]["kernel"]
    assert int(np.isnan(mu).sum()) == 27
    inf = str(tmp_path / "inf")
    assert _forge(source, inf, "__model__/layers_0.weight", np.inf, slice(4, 30)) == 26
    with pytest.raises(ValueError, match=r"'__model__/layers_0\.weight' holds 26 NaN or infinite"):
        load_param_shards(inf, four, allow_nonfinite=True)  # weights: never
