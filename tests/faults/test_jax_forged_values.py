"""gradsync_jax.load_optimizer_state refuses forged values before building any state
(issue 21 item 4; docs/design.md §15): a state tensor of the wrong shape, or one holding NaN,
unless ``allow_nonfinite=True``; a refused load leaves the data position where it was."""

from __future__ import annotations

import dataclasses
import os
import shutil
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from safetensors.numpy import load_file, save_file

from gradsync_core import Topology, read_manifest
from gradsync_core.checkpoint import sha256_file, write_manifest
from gradsync_jax import (
    ResumableSampler,
    load_optimizer_state,
    mesh_from_topology,
    save_optimizer_state,
    shard_optimizer,
)


def _forge(source: str, target: str, forge: Callable[[np.ndarray], np.ndarray]) -> None:
    """Copy ``source`` with the first ``exp_avg`` tensor replaced by ``forge(saved)`` in every
    rank file holding one, hashes and checksum redone."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    files = dict(manifest.files)
    for name in files:
        path = os.path.join(target, name)
        tensors = load_file(path)
        key = next((k for k in sorted(tensors) if k.endswith("/exp_avg")), None)
        if key is not None:
            tensors[key] = forge(tensors[key])
            save_file(tensors, path)
            files[name] = sha256_file(path)
    write_manifest(target, dataclasses.replace(manifest, files=files))


def test_forged_values_are_refused(tmp_path) -> None:
    mesh = mesh_from_topology(Topology.create(2), devices=jax.devices()[:2])
    tx = shard_optimizer(optax.adam(1e-2), mesh)
    params = {"w": jnp.ones((32, 16), jnp.float32), "b": jnp.zeros((16,), jnp.float32)}
    source = str(tmp_path / "source")
    saved_data = ResumableSampler(40, global_batch_size=8, seed=3)
    for _ in range(2):
        next(saved_data)
    save_optimizer_state(source, tx, tx.init(params), params, step=3, data=saved_data)
    cases = {
        "shape": (
            lambda t: np.zeros(3, t.dtype),
            # auto's flat-by-parameter layout: each of the 2 ranks holds 8 of b's 16 elements
            r"'b/exp_avg' is \(3,\) in rank-00000-of-00002\.safetensors, expected \(8,\)",
        ),
        "nan": (lambda t: np.full_like(t, np.nan), "NaN or infinite value"),
    }
    for how, (forge, message) in cases.items():
        _forge(source, str(tmp_path / how), forge)
        sampler = ResumableSampler(40, global_batch_size=8, seed=3)
        with pytest.raises(ValueError, match=message):
            load_optimizer_state(str(tmp_path / how), tx, params, data=sampler)
        assert sampler.cursor().consumed == 0, "a refused load moved the data position"
    state, manifest = load_optimizer_state(str(tmp_path / "nan"), tx, params, allow_nonfinite=True)
    assert manifest.step == 3
    assert any(
        np.isnan(np.asarray(x)).any() for x in jax.tree.leaves(tx.gather_state(state, params))
    )
