"""Same owners on both sides for any module structure (issue 22 item 5).

A transformer block registers its own parameter before its children's and its attention
projections ``q, k, v, o`` in that order; the Flax tree sorts them (``attn/k`` first, ``gain``
last), so equal-sized tensors tie in another order and the greedy owners differ. ``order=``
(torch's registration order, or a torch checkpoint's) makes them torch's.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from flax import nnx
from torch import nn

from gradsync_core import plan_buckets, plan_greedy_shards, read_manifest
from gradsync_jax import (
    load_optimizer_state,
    shard_optimizer,
    to_torch_state,
    torch_plan,
)
from gradsync_torch import ZeroRedundancyOptimizer
from gradsync_torch import param_specs as torch_param_specs
from tests.support.harness import run_workers
from tests.support.meshes import mesh_of

D = 8


class TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(D, D) for _ in range(4))


class TorchBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(D))  # the block's own, before its children's
        self.attn = TorchAttention()
        self.mlp = nn.Linear(D, D)


class FlaxAttention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.q, self.k, self.v, self.o = (nnx.Linear(D, D, rngs=rngs) for _ in range(4))


class FlaxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.gain = nnx.Param(jnp.ones(D))
        self.attn = FlaxAttention(rngs)
        self.mlp = nnx.Linear(D, D, rngs=rngs)


def owners(plan) -> dict[str, int]:
    return {s.name: s.rank for s in plan.shards}


def test_order_gives_torch_owners_to_a_transformer_block() -> None:
    torch_block = TorchBlock()
    order = [name for name, _ in torch_block.named_parameters()]
    want = plan_greedy_shards(torch_param_specs(torch_block), world_size=2)
    params = nnx.state(FlaxBlock(nnx.Rngs(0)), nnx.Param)
    natural = shard_optimizer(optax.adam(1e-3), mesh_of(2), partition="greedy")
    before = torch_plan(natural.plan(params))
    # The tree's sorted order ties otherwise: a test that cannot fail would prove nothing.
    assert owners(before) != owners(want)
    assert (owners(before)["attn.q.weight"], owners(before)["attn.v.weight"]) != (
        owners(want)["attn.q.weight"],
        owners(want)["attn.v.weight"],
    )
    tx = shard_optimizer(optax.adam(1e-3), mesh_of(2), partition="greedy", order=order)
    got = torch_plan(tx.plan(params))
    assert owners(got) == owners(want)
    assert got.fingerprint == want.fingerprint


def test_order_lays_flat_buckets_out_in_torch_registration_order() -> None:
    torch_block = TorchBlock()
    order = [name for name, _ in torch_block.named_parameters()]
    cap = 600  # bytes: a few tensors per bucket
    want = plan_buckets(torch_param_specs(torch_block), cap_bytes=cap, pad_to=2)
    params = nnx.state(FlaxBlock(nnx.Rngs(0)), nnx.Param)

    def slots(tx) -> list[list[str]]:
        plan = torch_plan(tx.plan(params)).buckets
        return [[slot.name for slot in bucket.slots] for bucket in plan.buckets]

    flat = {"partition": "flat", "bucket_cap_mb": cap / 2**20}
    wanted = [[slot.name for slot in bucket.slots] for bucket in want.buckets]
    assert slots(shard_optimizer(optax.adam(1e-3), mesh_of(2), **flat)) != wanted
    assert slots(shard_optimizer(optax.adam(1e-3), mesh_of(2), order=order, **flat)) == wanted


def test_order_must_name_every_parameter_once() -> None:
    params = nnx.state(FlaxBlock(nnx.Rngs(0)), nnx.Param)
    tx = shard_optimizer(
        optax.adam(1e-3), mesh_of(2), partition="greedy", order=["gain", "attn.q.weight"]
    )
    try:
        tx.plan(params)
    except ValueError as e:
        assert "order must list every torch name once" in str(e)
        assert "missing: ['attn.k.bias'" in str(e)
    else:
        raise AssertionError("an incomplete order was accepted")


def save_torch_block(rank: int, world_size: int, path: str, init: dict) -> dict:
    block = TorchBlock()
    block.load_state_dict({k: torch.from_numpy(v) for k, v in init.items()})
    opt = ZeroRedundancyOptimizer(block.named_parameters(), torch.optim.Adam, lr=1e-2)
    torch.manual_seed(rank)
    x = torch.randn(4, D)
    a = block.attn
    (block.mlp(a.o(a.q(x) + a.k(x) + a.v(x)) * block.gain) ** 2).sum().backward()
    opt.step()
    opt.save(path, model=block)
    return {"fingerprint": opt.plan().fingerprint}


@pytest.mark.slow
def test_a_torch_checkpoint_continues_with_its_owners(tmp_path) -> None:
    """A JAX run given the checkpoint's order adopts its owners: the fingerprints agree."""
    params = nnx.as_pure(nnx.state(FlaxBlock(nnx.Rngs(0)), nnx.Param))
    path = str(tmp_path / "ckpt")
    saved = run_workers(save_torch_block, 2, path, to_torch_state(params))[0]
    manifest = read_manifest(path)
    order = [p.name for p in manifest.params]
    tx = shard_optimizer(optax.adam(1e-2), mesh_of(2), partition="greedy", order=order)
    state, _ = load_optimizer_state(path, tx, params)
    plan = torch_plan(tx.plan(params))
    assert plan.fingerprint == saved["fingerprint"] == manifest.plan.fingerprint
    mu = tx.gather_state(state, params)[0].mu
    assert float(np.abs(np.asarray(mu["attn"]["v"]["kernel"])).max()) > 0  # state was loaded
