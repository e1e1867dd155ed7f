"""One plan for both frameworks: the JAX ZeRO-3 layout's fingerprint equals torch's.

The torch plan is what ``fully_shard`` executes (docs/design.md §16), built single-process
from ``gradsync_torch.param_specs(module)``; the JAX plan from the Flax twin's tree by
``param_layout``. Equal fingerprints mean the same names, shapes, dtypes, frozen flags, units
and cut; the device shards are then checked to hold exactly torch rank r's rows.
"""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gradsync_core import plan_param_shards
from gradsync_jax import param_layout, shard_params, to_torch_state
from tests.jax.test_param_sharding import FROZEN, UNITS, Tied, data, mesh_of

torch = pytest.importorskip("torch")
from gradsync_torch import param_specs as torch_param_specs  # noqa: E402
from tests.parity.torch_worker import RENAMES, WIDTHS, TorchMLP  # noqa: E402


class TorchTied(torch.nn.Module):
    """The torch twin of ``Tied``: the head shares the embedding's weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(6, 5)
        self.frozen = torch.nn.Linear(5, 3)
        self.layers_0 = torch.nn.Linear(3, 11)
        self.layers_1 = torch.nn.Linear(11, 5)
        self.head = torch.nn.Linear(5, 6, bias=False)
        self.head.weight = self.embed.weight
        self.frozen.requires_grad_(False)


class FlaxMLP(fnn.Module):
    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(WIDTHS[1:]):
            x = fnn.Dense(width)(x)
            x = jnp.tanh(x) if i < len(WIDTHS) - 2 else x
        return x


@pytest.mark.parametrize("world_size", [2, 3, 8])
def test_tied_frozen_uneven_model_has_torchs_fingerprint(world_size: int) -> None:
    params = jax.eval_shape(Tied().init, jax.random.key(0), data()[0])
    layout = param_layout(params, world_size=world_size, units=UNITS, frozen=FROZEN)
    torch_plan = plan_param_shards(
        torch_param_specs(TorchTied()), world_size=world_size, units=["layers_0", "layers_1"]
    )
    assert layout.plan.to_json() == torch_plan.to_json()
    assert layout.plan.fingerprint == torch_plan.fingerprint


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_mlp_with_renamed_modules_has_torchs_fingerprint(world_size: int) -> None:
    # Dense_10 sorts before Dense_2 in Flax: the layout must follow torch's order anyway.
    params = jax.eval_shape(FlaxMLP().init, jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
    units = [f"Dense_{i}" for i in range(0, len(WIDTHS) - 1, 3)]
    layout = param_layout(params, world_size=world_size, units=units, modules=RENAMES)
    torch_units = [f"layers.{i}" for i in range(0, len(WIDTHS) - 1, 3)]
    torch_plan = plan_param_shards(
        torch_param_specs(TorchMLP(WIDTHS)), world_size=world_size, units=torch_units
    )
    assert layout.plan.fingerprint == torch_plan.fingerprint
    # A wrong unit set or cut changes it: the comparison can fail.
    other = plan_param_shards(torch_param_specs(TorchMLP(WIDTHS)), world_size=world_size)
    assert layout.plan.fingerprint != other.fingerprint


def test_each_device_holds_torch_rank_rs_rows() -> None:
    params = Tied().init(jax.random.key(0), data()[0])
    layout = param_layout(params, world_size=4, units=UNITS, frozen=FROZEN)
    sharded = shard_params(params, mesh_of(4), layout)
    state = to_torch_state(params)  # torch names and layouts: what torch rank r would cut
    flat = jax.tree_util.tree_leaves(sharded)
    for leaf, array in zip(layout.leaves, flat, strict=True):
        shards = sorted(array.addressable_shards, key=lambda s: s.index[0].start)
        for r, shard in enumerate(shards):
            chunk = layout.plan.chunk(leaf.name, r)
            held = np.asarray(shard.data)[: chunk.stop - chunk.start]
            np.testing.assert_array_equal(held, state[leaf.name][chunk.start : chunk.stop])
            assert shard.data.shape == chunk.padded_shape
