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
from tests.jax.zero3_problem import FROZEN, UNITS, Tied, data
from tests.support.meshes import dp_mesh as mesh_of  # this file's name for it

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


class TorchGPTBlock(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(4)
        self.attn = torch.nn.Linear(4, 12)
        self.mlp = torch.nn.Linear(4, 7)


class TorchGPT(torch.nn.Module):
    """GPT-2's names (``transformer.h.0.ln_1``) registered in an order that is not the natural
    one (``wte`` first and ``ln_1`` before ``attn``; the natural order puts ``wte`` last and
    ``attn`` first), the head tied to the embedding, the final LayerNorm frozen."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = torch.nn.ModuleDict(
            {
                "wte": torch.nn.Embedding(9, 4),
                "h": torch.nn.ModuleList(TorchGPTBlock() for _ in range(2)),
                "ln_f": torch.nn.LayerNorm(4),
            }
        )
        self.lm_head = torch.nn.Linear(4, 9, bias=False)
        self.lm_head.weight = self.transformer["wte"].weight
        self.transformer["ln_f"].requires_grad_(False)


class FlaxGPTBlock(fnn.Module):
    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = fnn.LayerNorm(name="ln_1")(x)
        return x + fnn.Dense(12, name="attn")(h)[..., :4] + fnn.Dense(7, name="mlp")(h)[..., :4]


class FlaxTransformer(fnn.Module):
    @fnn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        wte = fnn.Embed(9, 4, name="wte")
        x = wte(tokens)
        for i in range(2):
            x = FlaxGPTBlock(name=f"h_{i}")(x)
        return wte.attend(fnn.LayerNorm(name="ln_f")(x))


class FlaxGPT(fnn.Module):
    @fnn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        return FlaxTransformer(name="transformer")(tokens)


GPT_RENAMES = {f"transformer/h_{i}": f"transformer.h.{i}" for i in range(2)}


@pytest.mark.parametrize("world_size", [2, 3])
def test_units_and_frozen_in_torchs_spelling_make_torchs_plan(world_size: int) -> None:
    """``units=["transformer.h.0", ...]`` (the spelling of ``fully_shard`` and the CLI) plans
    what the Flax spelling plans, and with ``order=`` torch's registration order, torch's plan."""
    params = jax.eval_shape(FlaxGPT().init, jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    twin = TorchGPT()
    torch_units = ["transformer.h.0", "transformer.h.1"]
    torch_plan = plan_param_shards(
        torch_param_specs(twin), world_size=world_size, units=torch_units
    )
    order = [name for name, _ in twin.named_parameters()]
    common = {"world_size": world_size, "modules": GPT_RENAMES, "order": order}
    dotted = param_layout(params, units=torch_units, frozen=["transformer.ln_f"], **common)
    slashed = param_layout(
        params, units=["transformer/h_0", "transformer/h_1"], frozen=["transformer/ln_f"], **common
    )
    assert dotted.plan.to_json() == slashed.plan.to_json() == torch_plan.to_json()
    assert dotted.plan.fingerprint == torch_plan.fingerprint
    # Without order= the natural order (attn before ln_1, wte last) is not torch's: the
    # fingerprint differs, as docs/jax-zero3.md says.
    natural = param_layout(
        params, units=torch_units, frozen=["transformer.ln_f"], **common | {"order": None}
    )
    assert natural.plan.fingerprint != torch_plan.fingerprint


def test_a_path_in_neither_or_both_spellings_is_refused() -> None:
    params = jax.eval_shape(FlaxGPT().init, jax.random.key(0), jnp.zeros((2, 3), jnp.int32))
    with pytest.raises(
        ValueError, match=r"'transformer\.h\.7' matches no parameter.*torch spelling"
    ):
        param_layout(params, world_size=2, units=["transformer.h.7"], modules=GPT_RENAMES)
    # Flax's "a" is torch's "b" and Flax's "b" torch's "a": "a" could mean either module.
    swapped = {"params": {"a": {"kernel": jnp.zeros((2, 3))}, "b": {"kernel": jnp.zeros((2, 5))}}}
    with pytest.raises(ValueError, match="unit 'a' is both the Flax path of torch module 'b'"):
        param_layout(swapped, world_size=2, units=["a"], modules={"a": "b", "b": "a"})
