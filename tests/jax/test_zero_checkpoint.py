"""shard_optimizer checkpoints: saved on 8 devices, resumed on 4; bad checkpoints refused.

The model is trained for real (``jax.grad`` of local losses w.r.t. ``make_local(params)``)
and compared with the unsharded Optax optimizer on the full batch: the loaded state must be
bitwise the saved one; the resumed training matches the reference within 1e-5 relative
(the 4- and 8-device gradient sums round differently from the full-batch one).
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest
from safetensors.numpy import load_file

from gradsync_jax import (
    ResumableSampler,
    load_optimizer_state,
    save_optimizer_state,
    shard_optimizer,
)
from gradsync_jax.zero.gathered import GatheredLayout
from tests.jax.zero_checkpoint_problem import batch, inner, loss_fn, params0, reference, train
from tests.support.asserts import assert_tree_close, assert_tree_equal
from tests.support.meshes import mesh_of


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Three steps on 8 devices (greedy), saved."""
    directory = str(tmp_path_factory.mktemp("ckpt") / "opt")
    tx8 = shard_optimizer(inner(), mesh_of(8))
    params, state = train(tx8, params0(), tx8.init(params0()), range(3))
    save_optimizer_state(directory, tx8, state, params, step=3)
    return directory, params, tx8.gather_state(state, params)


@pytest.mark.parametrize("partition", [pytest.param("greedy", marks=pytest.mark.slow), "flat"])
def test_saved_on_8_resumes_on_4(saved, partition: str) -> None:
    directory, params, saved_state = saved
    tx4 = shard_optimizer(inner(), mesh_of(4), partition=partition)
    state, manifest = load_optimizer_state(directory, tx4, params)
    assert (manifest.world_size, manifest.step, manifest.framework) == (8, 3, "jax")
    assert_tree_equal(
        tx4.gather_state(state, params), saved_state, same_structure=True
    )  # bitwise, resharded 8 -> 4
    for leaf, want in zip(
        jax.tree.leaves(state), jax.tree.leaves(tx4.state_shardings(params)), strict=True
    ):
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim)
    params, state = train(tx4, params, state, range(3, 6))
    ref_params, ref_state = reference(6)
    assert_tree_close(params, ref_params, atol_rel=1e-6)
    assert_tree_close(tx4.gather_state(state, params), ref_state, atol_rel=1e-6)


def test_the_data_position_travels_in_the_manifest(saved, tmp_path) -> None:
    """save_optimizer_state(..., data=sampler) stores the cursor; a load with data= puts it
    back; a load with data= from a checkpoint saved without it refuses."""
    directory, params, _ = saved
    tx8 = shard_optimizer(inner(), mesh_of(8))
    state = tx8.init(params)
    sampler = ResumableSampler(40, global_batch_size=8, seed=3)
    for _ in range(7):  # one epoch of 5 steps, then 2 more
        next(sampler)
    with_data = str(tmp_path / "with-data")
    manifest = save_optimizer_state(with_data, tx8, state, params, step=7, data=sampler)
    assert manifest.extra["data"] == sampler.state_dict()
    resumed = ResumableSampler(40, global_batch_size=8, seed=3)
    _, loaded = load_optimizer_state(with_data, tx8, params, data=resumed)
    assert loaded.extra["data"] == sampler.state_dict()
    assert (resumed.cursor().epoch, resumed.cursor().consumed) == (1, 16)
    assert np.array_equal(next(resumed), next(sampler))  # the same samples next
    with pytest.raises(ValueError, match="holds no data position"):
        load_optimizer_state(directory, tx8, params, data=resumed)


def test_files_are_per_parameter(saved) -> None:
    """Version 2: torch names, layouts and state keys; Optax's count as every step."""
    directory = saved[0]
    with open(os.path.join(directory, "manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["version"] == 2
    assert sorted(manifest["files"]) == [f"rank-{r:05d}-of-00008.safetensors" for r in range(8)]
    assert manifest["state_keys"]["head.weight"] == ["exp_avg", "exp_avg_sq", "step"]
    assert manifest["extra"]["scalars"]["head.weight/step"] == 3
    # Rank r's file holds what the plan gives rank r (whole tensors or element ranges of the
    # flattened one); put together they are the full moment in torch's (out, in) layout.
    shards = sorted(
        (s for s in manifest["plan"]["shards"] if s[0] == "dense_0.weight"), key=lambda s: s[2]
    )
    pieces = [
        load_file(os.path.join(directory, f"rank-{rank:05d}-of-00008.safetensors"))[
            "dense_0.weight/exp_avg"
        ].reshape(-1)
        for _, rank, *_ in shards
    ]
    mu = saved[2].inner_state[0].mu["dense_0"]["kernel"]
    np.testing.assert_array_equal(np.concatenate(pieces).reshape(10, 6), np.asarray(mu).T)
    rank0 = load_file(os.path.join(directory, "rank-00000-of-00008.safetensors"))
    assert "__optax__/hyperparams.learning_rate" in rank0
    assert manifest["extra"]["global_keys"][0] == "hyperparams.b1"


def test_bad_checkpoints_are_refused(saved, tmp_path) -> None:
    directory, params, _ = saved
    tx = shard_optimizer(inner(), mesh_of(2))
    state = tx.init(params)
    before = tx.gather_state(state, params)

    corrupt = tmp_path / "corrupt"
    shutil.copytree(directory, corrupt)
    name = corrupt / "rank-00001-of-00008.safetensors"
    data = bytearray(name.read_bytes())
    data[-1] ^= 0xFF
    name.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="does not match its manifest hash"):
        load_optimizer_state(corrupt, tx, params)

    with pytest.raises(ValueError, match=r"has no manifest\.json"):
        load_optimizer_state(tmp_path / "nothing", tx, params)

    other_model = jax.tree.map(lambda x: jnp.zeros((*x.shape[:-1], x.shape[-1] + 1)), params)
    with pytest.raises(ValueError, match="another model"):
        load_optimizer_state(directory, shard_optimizer(inner(), mesh_of(2)), other_model)

    with pytest.raises(ValueError, match="written by optimizer"):
        load_optimizer_state(directory, shard_optimizer(optax.lion(1e-3), mesh_of(2)), params)

    # Nothing was touched: the state in hand is the one from before the failed loads.
    assert_tree_equal(tx.gather_state(state, params), before, same_structure=True)

    # Saving over it on 2 devices replaces the 8 rank files; the result loads.
    save_optimizer_state(corrupt, tx, state, params, step=0)
    assert sorted(p.name for p in corrupt.iterdir()) == [
        "manifest.json",
        "rank-00000-of-00002.safetensors",
        "rank-00001-of-00002.safetensors",
    ]
    assert_tree_equal(
        tx.gather_state(load_optimizer_state(corrupt, tx, params)[0], params),
        before,
        same_structure=True,
    )


def test_bfloat16_state_round_trip(tmp_path) -> None:
    """bf16 moments survive a save on 2 devices and a load on 4 (safetensors BF16)."""
    params = jax.tree.map(lambda x: x.astype(jnp.bfloat16), params0())
    tx2 = shard_optimizer(optax.adam(1e-2, mu_dtype=jnp.bfloat16), mesh_of(2))
    state = tx2.init(params)
    state = tx2.scatter_state(
        jax.tree.map(lambda x: np.full(x.shape, 0.375, x.dtype), tx2.gather_state(state, params)),
        params,
    )
    save_optimizer_state(tmp_path / "bf16", tx2, state, params, step=1)
    tx4 = shard_optimizer(optax.adam(1e-2, mu_dtype=jnp.bfloat16), mesh_of(4), partition="flat")
    loaded, _ = load_optimizer_state(tmp_path / "bf16", tx4, params)
    got = tx4.gather_state(loaded, params)
    assert got[0].mu["head"]["kernel"].dtype == jnp.bfloat16
    assert_tree_equal(got, tx2.gather_state(state, params), same_structure=True)


def test_version_1_of_the_other_framework_is_refused_with_how_to_convert(saved, tmp_path) -> None:
    """A version-1 checkpoint (framework-specific names) crosses over only after a load and
    save in the framework that wrote it; the refusal says so, whatever the rest holds."""
    directory, params, _ = saved
    old = tmp_path / "torch-v1"
    shutil.copytree(directory, old)
    manifest = json.loads((old / "manifest.json").read_text())
    manifest.update(version=1, framework="torch", optimizer="torch.optim.AdamW")
    del manifest["checksum"]  # version-1 manifests may have none
    (old / "manifest.json").write_text(json.dumps(manifest))
    tx = shard_optimizer(inner(), mesh_of(2))
    with pytest.raises(
        ValueError,
        match=r"written by gradsync_torch in format version 1, which only gradsync_torch reads; "
        r"load it there \(ZeroRedundancyOptimizer.load\) and save it again",
    ):
        load_optimizer_state(old, tx, params)


@pytest.mark.slow
def test_gathered_saved_on_8_resumes_on_4(tmp_path) -> None:
    """A coupled optimizer (auto: gathered) checkpoints like greedy: saved on 8 devices,
    loaded on 4 bitwise, the resumed training matches the unsharded reference."""

    def prodigy() -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(1.0), optax.contrib.prodigy(0.5))

    tx8 = shard_optimizer(prodigy(), mesh_of(8))
    assert isinstance(tx8.layout(params0()), GatheredLayout)
    params, state = train(tx8, params0(), tx8.init(params0()), range(3))
    save_optimizer_state(tmp_path / "prodigy", tx8, state, params, step=3)
    tx4 = shard_optimizer(prodigy(), mesh_of(4))
    loaded, _ = load_optimizer_state(tmp_path / "prodigy", tx4, params)
    assert_tree_equal(
        tx4.gather_state(loaded, params), tx8.gather_state(state, params), same_structure=True
    )
    params, loaded = train(tx4, params, loaded, range(3, 6))
    ref_tx = prodigy()
    ref_params, ref_state = params0(), ref_tx.init(params0())
    for i in range(6):
        grads = jax.grad(loss_fn)(ref_params, *batch(i))
        updates, ref_state = ref_tx.update(grads, ref_state, ref_params)
        ref_params = optax.apply_updates(ref_params, updates)
    assert_tree_close(params, ref_params, atol_rel=1e-6)
    assert_tree_close(tx4.gather_state(loaded, params), ref_state, atol_rel=1e-6)
