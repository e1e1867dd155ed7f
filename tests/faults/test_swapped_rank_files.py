"""Rank files that were swapped are refused, in both frameworks, for every kind of save
(issue 33, item 6; docs/design.md §9).

Every rank file records its rank and the world size in its safetensors metadata, and every
load checks them against the file's name. The forgery: two rank files of a 4-rank save
trade places and the manifest's hashes are redone, so every hash matches. Under a flat or
dim-0 plan (ZeRO-2, ZeRO-3, JAX's flat partition and ``save_param_shards``) the slices are
equally long, so without the check each rank silently took the other's rows of every
AdamW moment. JAX rank files written before they recorded their rank (they record only
``framework``) still load, read as named.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import pytest
import torch
from torch import nn

from gradsync_core import read_manifest
from gradsync_core.checkpoint import rank_file, resolve_checkpoint, sha256_file, write_manifest
from tests.support.harness import run_workers

SWAPPED = r"rank-00001-of-00004\.safetensors records rank 2 of 4 but is named for rank 1 of 4: "


def swap_rank_files(source: str, target: str, a: int = 1, b: int = 2) -> str:
    """A copy of checkpoint ``source`` at ``target`` whose rank files ``a`` and ``b`` trade
    places, the manifest's hashes and checksum redone: every hash matches."""
    shutil.copytree(resolve_checkpoint(source), target)
    manifest = read_manifest(target)
    n = manifest.world_size
    first, second = (os.path.join(target, rank_file(r, n)) for r in (a, b))
    os.rename(first, first + ".swap")
    os.rename(second, first)
    os.rename(first + ".swap", second)
    files = dict(manifest.files)
    files[rank_file(a, n)], files[rank_file(b, n)] = files[rank_file(b, n)], files[rank_file(a, n)]
    write_manifest(target, dataclasses.replace(manifest, files=files))
    assert all(sha256_file(os.path.join(target, f)) == h for f, h in files.items())
    return target


def _torch_saves(rank: int, world_size: int, root: str) -> None:
    """4 ranks: a ZeRO-3 (``fully_shard``) and a ZeRO-2 save after one AdamW step; rank 0
    swaps files 1 and 2 of each; every rank's load of a swapped copy is refused."""
    import torch.distributed as dist

    from gradsync_torch import (
        ZeroRedundancyOptimizer,
        fully_shard,
        load_param_shards,
        save_param_shards,
    )

    def sharded(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(seed)
        model = fully_shard(nn.Linear(8, 8))  # 2 of the 8 rows per rank
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = sharded(0)
    model(torch.full((2, 8), float(rank + 1))).square().mean().backward()
    opt.step()
    save_param_shards(os.path.join(root, "z3"), model, opt)

    torch.manual_seed(0)
    flat = nn.Linear(8, 8)
    zero2 = ZeroRedundancyOptimizer(
        flat.named_parameters(), torch.optim.AdamW, lr=1e-2, shard_gradients=True
    )
    flat(torch.ones(2, 8)).square().mean().backward()
    zero2.step()
    zero2.save(os.path.join(root, "z2"), model=flat)

    if rank == 0:
        for name in ("z3", "z2"):
            swap_rank_files(os.path.join(root, name), os.path.join(root, f"{name}-swapped"))
    dist.barrier()
    again, again_opt = sharded(1)
    with pytest.raises(ValueError, match=SWAPPED):
        load_param_shards(os.path.join(root, "z3-swapped"), again, again_opt)
    assert again_opt.state_dict()["state"] == {}  # refused: nothing loaded
    load_param_shards(os.path.join(root, "z3"), again, again_opt)  # the real one loads
    with pytest.raises(ValueError, match=SWAPPED):
        zero2.load(os.path.join(root, "z2-swapped"), model=flat)


@pytest.mark.slow
def test_torch_swapped_rank_files_are_refused(tmp_path) -> None:
    from gradsync_torch import load_optimizer_state_dict

    root = str(tmp_path)
    run_workers(_torch_saves, 4, root)
    model = nn.Linear(8, 8)  # and in one process, by the plain loader
    with pytest.raises(ValueError, match=SWAPPED):
        load_optimizer_state_dict(
            os.path.join(root, "z3-swapped"), torch.optim.AdamW(model.parameters()), model
        )


def _jax_saved(path: str, partition: str) -> tuple[Any, Any]:
    """One AdamW step of zero_checkpoint_problem.py's model on 4 devices, saved with its weights."""
    import optax

    from gradsync_jax import save_optimizer_state, shard_optimizer
    from tests.jax.zero_checkpoint_problem import params0, train
    from tests.support.meshes import mesh_of

    tx = shard_optimizer(optax.adamw(1e-2), mesh_of(4), partition=partition)
    params, state = train(tx, params0(), tx.init(params0()), range(1))
    save_optimizer_state(path, tx, state, params, step=1, model=params)
    return tx, params


@pytest.mark.parametrize("partition", ["greedy", "flat"], ids=["zero1", "zero2"])
def test_jax_swapped_rank_files_are_refused(tmp_path, partition: str) -> None:
    from gradsync_jax import load_optimizer_state, load_params

    source = str(tmp_path / "ckpt")
    tx, params = _jax_saved(source, partition)
    swapped = swap_rank_files(source, str(tmp_path / "swapped"))
    with pytest.raises(ValueError, match=SWAPPED):
        load_optimizer_state(swapped, tx, params)
    with pytest.raises(ValueError, match=SWAPPED):
        load_params(swapped, params)
    load_optimizer_state(source, tx, params)  # the real one loads


def test_jax_swapped_param_shards_are_refused(tmp_path) -> None:
    import jax
    import jax.numpy as jnp
    import optax

    from gradsync_jax import (
        load_param_shards,
        param_layout,
        save_param_shards,
        shard_params,
        zero3_step,
    )
    from tests.support.meshes import dp_mesh

    params = {"dense": {"kernel": jnp.arange(64.0).reshape(8, 8) / 64, "bias": jnp.zeros(8)}}

    def loss_fn(p: Any, x: jax.Array) -> jax.Array:
        return jnp.sum((x @ p["dense"]["kernel"] + p["dense"]["bias"]) ** 2)

    step = zero3_step(loss_fn, optax.adamw(1e-2), dp_mesh(4), param_layout(params, world_size=4))
    sharded = shard_params(params, step.mesh, step.layout)
    sharded, state, _ = step(sharded, step.init(sharded), jnp.ones((4, 8)))
    source = str(tmp_path / "z3")
    save_param_shards(source, step, sharded, state, step=1)  # 2 of the 8 rows per device
    swapped = swap_rank_files(source, str(tmp_path / "swapped"))
    with pytest.raises(ValueError, match=SWAPPED):
        load_param_shards(swapped, step)
    load_param_shards(source, step)  # the real one loads


def test_jax_rank_files_that_record_no_rank_still_load(tmp_path) -> None:
    # Written before rank files recorded their rank: only {"framework": "jax"}. Read as named,
    # so every JAX checkpoint already written loads; one recording another rank does not.
    from safetensors.numpy import load_file, save_file

    from gradsync_jax import load_optimizer_state

    source = str(tmp_path / "ckpt")
    tx, params = _jax_saved(source, "flat")
    manifest = read_manifest(resolve_checkpoint(source))

    def rewrite(target: str, metadata: dict[str, str]) -> str:
        shutil.copytree(resolve_checkpoint(source), target)
        files = {}
        for name in manifest.files:
            path = os.path.join(target, name)
            save_file(load_file(path), path, metadata=metadata)
            files[name] = sha256_file(path)
        write_manifest(target, dataclasses.replace(manifest, files=files))
        return target

    old = rewrite(str(tmp_path / "old"), {"framework": "jax"})
    want = tx.gather_state(load_optimizer_state(source, tx, params)[0], params)
    got = tx.gather_state(load_optimizer_state(old, tx, params)[0], params)
    assert all(bool((a == b).all()) for a, b in zip(*map(jax_leaves, (got, want)), strict=True))
    lying = rewrite(str(tmp_path / "lying"), {"framework": "jax", "rank": "0", "world": "4"})
    with pytest.raises(ValueError, match=r"rank-00001-of-00004\.safetensors records rank 0 of 4"):
        load_optimizer_state(lying, tx, params)


def jax_leaves(tree: Any) -> list[Any]:
    import jax

    return jax.tree.leaves(tree)
