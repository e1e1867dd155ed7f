"""The JAX executor's renamed keywords and ZeRO-3's options record (docs/design.md §13).

Each old spelling is the call of the new one: the same checkpoint written (manifests and
files' tensors equal), the same trees read, the same step; it warns once per process, and
both spellings at once are a ``TypeError``. ``zero3_step(options=Zero3Options(...))`` and
``Zero3Step(loss_fn, tx, mesh, layout, options)`` are the keywords' step, bitwise.
"""

from __future__ import annotations

import dataclasses
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P
from safetensors import safe_open

from gradsync_jax import (
    Zero3Options,
    Zero3Step,
    load_optimizer_state,
    load_param_shards,
    load_params,
    param_layout,
    save_optimizer_state,
    save_param_shards,
    shard_optimizer,
    shard_params,
    shared_param_specs,
    unshard_params,
    zero3_step,
)


def init_params() -> dict:
    rng = np.random.default_rng(0)
    return {
        "params": {
            "Dense_0": {
                "kernel": rng.standard_normal((4, 6)).astype(np.float32),
                "bias": rng.standard_normal(6).astype(np.float32),
            },
            "Dense_1": {"kernel": rng.standard_normal((6, 2)).astype(np.float32)},
        }
    }


def loss_fn(params, batch):
    x, y = batch
    p = params["params"]
    h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
    return jnp.mean((h @ p["Dense_1"]["kernel"] - y) ** 2)


def batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((8, 4)).astype(np.float32), rng.standard_normal((8, 2)).astype(
        np.float32
    )


def mesh(n: int, names: tuple[str, ...] = ("dp",), shape: tuple[int, ...] | None = None):
    return Mesh(np.array(jax.devices()[:n]).reshape(shape or (n,)), names)


def assert_trees_equal(a, b) -> None:
    la, ta = jax.tree_util.tree_flatten(a)
    lb, tb = jax.tree_util.tree_flatten(b)
    assert ta == tb
    for x, y in zip(la, lb, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def assert_same_checkpoint(a, manifest_a, b, manifest_b) -> None:
    """The same manifest and the same files' tensors and metadata (the bytes may differ:
    safetensors writes its metadata map in no fixed order)."""
    assert dataclasses.replace(manifest_a, files={}) == dataclasses.replace(manifest_b, files={})
    assert manifest_a.files.keys() == manifest_b.files.keys()
    for name in manifest_a.files:
        files = [os.path.join(os.path.realpath(path), name) for path in (a, b)]
        with safe_open(files[0], "np") as fa, safe_open(files[1], "np") as fb:
            assert fa.metadata() == fb.metadata()
            assert sorted(fa.keys()) == sorted(fb.keys())
            for key in fa.keys():
                np.testing.assert_array_equal(fa.get_tensor(key), fb.get_tensor(key))


def message(where: str, old: str, new: str) -> str:
    return f"{where}({old}=) is deprecated and will be removed: use {where}({new}=)"


def test_zero1_save_and_load_take_directory_and_optimizer(tmp_path, deprecations) -> None:
    """``directory=``/``optimizer=`` of save/load_optimizer_state, ``directory=``/``cast=`` of
    load_params: the same checkpoint, the same state and weights, one warning each."""
    params = init_params()
    tx = shard_optimizer(optax.adamw(1e-2), mesh(2))
    state = tx.init(params)
    new = save_optimizer_state(
        tmp_path / "new", tx, state, params, step=3, optimizer_name="adamw", model=params
    )
    assert deprecations.messages == []
    for name in ("old", "again"):
        old = save_optimizer_state(
            directory=tmp_path / name,
            tx=tx,
            state=state,
            params=params,
            step=3,
            optimizer="adamw",
            model=params,
        )
        assert_same_checkpoint(tmp_path / name, old, tmp_path / "new", new)
    want, _ = load_optimizer_state(tmp_path / "new", tx, params, optimizer_name="adamw")
    got, _ = load_optimizer_state(
        directory=tmp_path / "old", tx=tx, params=params, optimizer="adamw"
    )
    assert_trees_equal(got, want)

    half = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params)
    want = load_params(tmp_path / "new", half, allow_dtype_conversion=True)
    assert_trees_equal(load_params(directory=tmp_path / "old", like=half, cast=True), want)
    assert jax.tree.leaves(want)[0].dtype == jnp.bfloat16
    assert deprecations.messages == [
        message("save_optimizer_state", "directory", "path"),
        message("save_optimizer_state", "optimizer", "optimizer_name"),
        message("load_optimizer_state", "directory", "path"),
        message("load_optimizer_state", "optimizer", "optimizer_name"),
        message("load_params", "directory", "path"),
        message("load_params", "cast", "allow_dtype_conversion"),
    ]
    with pytest.raises(TypeError, match=r"load_params\(\) got allow_dtype_conversion= and its"):
        load_params(tmp_path / "new", half, cast=True, allow_dtype_conversion=True)


def test_shared_param_specs_takes_data_spec(deprecations) -> None:
    params = init_params()
    specs = jax.tree.map(lambda _: P(), params)
    m = mesh(2, ("dp", "cp"), (1, 2))
    want = shared_param_specs(params, specs, data_axes=P("dp", "cp"), mesh=m)
    assert want == shared_param_specs(params, specs, data_axes=("dp", "cp"), mesh=m)
    assert {s.replicated_over for s in want} == {("cp",)}
    assert shared_param_specs(params, specs, data_spec=P("dp", "cp"), mesh=m) == want
    assert deprecations.messages == [message("shared_param_specs", "data_spec", "data_axes")]


def test_zero3_options_as_a_record_are_the_keywords_bitwise() -> None:
    """Non-default options through the record, ``zero3_step``'s keywords, and ``Zero3Step``
    itself: the same step's bits after two steps."""
    params, m = init_params(), mesh(2)
    layout = param_layout(params, world_size=2)
    keywords = {"reshard_after_forward": False, "accumulate_steps": 2, "donate": False}
    options = Zero3Options(**keywords)
    steps = [
        zero3_step(loss_fn, optax.adamw(1e-2), m, layout, **keywords),
        zero3_step(loss_fn, optax.adamw(1e-2), m, layout, options=options),
        Zero3Step(loss_fn, optax.adamw(1e-2), m, layout, options),
    ]
    assert steps[0].options == options and steps[0].accumulate_steps == 2
    runs = []
    for step in steps:
        sharded = shard_params(params, m, layout)
        opt_state = step.init(sharded)
        for _ in range(2):
            sharded, opt_state, _ = step(sharded, opt_state, batch())
        runs.append(jax.tree.map(np.asarray, (unshard_params(sharded, layout), opt_state)))
    for run in runs[1:]:
        jax.tree.map(np.testing.assert_array_equal, runs[0], run)
    with pytest.raises(TypeError, match=r"got options= and accumulate_steps=, which it also"):
        zero3_step(loss_fn, optax.adamw(1e-2), m, layout, options=options, accumulate_steps=2)
    with pytest.raises(TypeError, match="options= and the deprecated param_dtype="):
        zero3_step(loss_fn, optax.adamw(1e-2), m, layout, options=options, param_dtype=jnp.bfloat16)
    with pytest.raises(ValueError, match="accumulate_steps must be a positive int, got 0"):
        Zero3Options(accumulate_steps=0)


def test_zero3_takes_replicate_axis_and_param_shards_directory_and_optimizer(
    tmp_path, deprecations
) -> None:
    params = init_params()
    layout = param_layout(params, world_size=4, dp_shard=2)
    m = mesh(4, ("replicate", "shard"), (2, 2))
    step = zero3_step(
        loss_fn, optax.adamw(1e-2), m, layout, axis_name="shard", replicate_axis_name="replicate"
    )
    old = zero3_step(
        loss_fn, optax.adamw(1e-2), m, layout, axis_name="shard", replicate_axis="replicate"
    )
    assert old.options == step.options and old.axes == step.axes == ("shard",)

    sharded = shard_params(params, m, layout, axis_name="shard")
    opt_state = step.init(sharded)
    new = save_param_shards(tmp_path / "new", step, sharded, opt_state, step=1, optimizer_name="x")
    saved = save_param_shards(
        directory=tmp_path / "old",
        zero3=step,
        params=sharded,
        opt_state=opt_state,
        step=1,
        optimizer="x",
    )
    assert_same_checkpoint(tmp_path / "old", saved, tmp_path / "new", new)
    want = load_param_shards(tmp_path / "new", step, optimizer_name="x")
    got = load_param_shards(directory=tmp_path / "old", zero3=step, optimizer="x")
    assert_trees_equal(got[:2], want[:2])
    assert_trees_equal(unshard_params(got[0], layout), params)
    assert deprecations.messages == [
        message("zero3_step", "replicate_axis", "replicate_axis_name"),
        message("save_param_shards", "directory", "path"),
        message("save_param_shards", "optimizer", "optimizer_name"),
        message("load_param_shards", "directory", "path"),
        message("load_param_shards", "optimizer", "optimizer_name"),
    ]


def test_orbax_takes_optimizer_for_tx_and_the_cli_its_old_key(tmp_path, deprecations) -> None:
    ocp = pytest.importorskip("orbax.checkpoint", reason="orbax-checkpoint is not installed")
    from gradsync_core.cli._main import main
    from gradsync_jax import export_orbax

    params = init_params()
    tx = shard_optimizer(optax.adamw(1e-2), mesh(1))
    save_optimizer_state(tmp_path / "src", tx, tx.init(params), params, step=2, model=params)
    export_orbax(tmp_path / "src", tmp_path / "new", params=params, tx=optax.adamw(1e-2))
    export_orbax(tmp_path / "src", tmp_path / "old", params=params, optimizer=optax.adamw(1e-2))
    (tmp_path / "build.py").write_text(
        "import optax\n"
        "from tests.jax.test_old_spellings import init_params\n"
        "def build():\n"
        "    return {'params': init_params(), 'optimizer': optax.adamw(1e-2)}\n"
    )
    build = f"{tmp_path / 'build.py'}:build"
    src, cli = str(tmp_path / "src"), str(tmp_path / "cli")
    assert main(["checkpoint", "export", "--to", "orbax", src, cli, "--model", build]) == 0
    target = {"params": params, "opt_state": optax.adamw(1e-2).init(params)}
    restored = [
        ocp.StandardCheckpointer().restore(str(tmp_path / name), target)
        for name in ("new", "old", "cli")
    ]
    assert_trees_equal(restored[1], restored[0])
    assert_trees_equal(restored[2], restored[0])
    assert deprecations.messages == [message("export_orbax", "optimizer", "tx")]
