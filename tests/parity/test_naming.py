"""gradsync_jax naming: torch names, layouts and registration order from a Flax tree."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import torch
from flax import nnx
from torch import nn

from gradsync_core import ParamSpec
from gradsync_jax import from_torch_state, to_torch_state, torch_names, torch_specs
from gradsync_jax._naming import from_torch_layout, to_torch_layout, torch_name
from gradsync_torch import param_specs


def _dense(n_in: int, n_out: int) -> dict:
    return {"kernel": np.zeros((n_in, n_out), np.float32), "bias": np.zeros(n_out, np.float32)}


def test_natural_order_puts_dense_2_before_dense_10() -> None:
    tree = {"params": {f"Dense_{i}": _dense(3, 3) for i in range(12)}}
    flat = [name for name in torch_names(tree)]
    assert flat[:4] == ["Dense_0.bias", "Dense_0.weight", "Dense_1.bias", "Dense_1.weight"]
    assert flat[4] == "Dense_10.bias"  # jax's sorted-key order, which torch_specs fixes:
    names = [s.name for s in torch_specs(tree)]
    assert names[:5] == [
        "Dense_0.weight",
        "Dense_0.bias",
        "Dense_1.weight",
        "Dense_1.bias",
        "Dense_2.weight",
    ]
    assert names[-2:] == ["Dense_11.weight", "Dense_11.bias"]


def test_layouts_match_torch_linear_conv_norm_embedding() -> None:
    rng = np.random.default_rng(0)
    conv_kernel = rng.normal(size=(3, 5, 4, 8)).astype(np.float32)  # (kh, kw, in, out)
    torch_conv = nn.Conv2d(4, 8, (3, 5))
    assert to_torch_layout("Conv_0/kernel", conv_kernel).shape == tuple(torch_conv.weight.shape)
    np.testing.assert_array_equal(
        from_torch_layout("Conv_0/kernel", to_torch_layout("Conv_0/kernel", conv_kernel)),
        conv_kernel,
    )
    # The mapped conv computes what torch computes.
    x = rng.normal(size=(1, 4, 7, 9)).astype(np.float32)
    with torch.no_grad():
        torch_conv.weight.copy_(torch.from_numpy(to_torch_layout("Conv_0/kernel", conv_kernel)))
        torch_conv.bias.zero_()
        expected = torch_conv(torch.from_numpy(x)).numpy()
    got = jax.lax.conv_general_dilated(
        x.transpose(0, 2, 3, 1),
        conv_kernel,
        (1, 1),
        "VALID",
        dimension_numbers=("NHWC", "HWIO", "NHWC"),
    )
    np.testing.assert_allclose(np.asarray(got).transpose(0, 3, 1, 2), expected, atol=1e-5)

    tree = {
        "params": {
            "embed": {"embedding": np.zeros((10, 4), np.float32)},
            "norm": {"scale": np.zeros(4, np.float32), "bias": np.zeros(4, np.float32)},
            "fc": _dense(4, 6),
        }
    }
    specs = {s.name: s.shape for s in torch_specs(tree)}
    assert specs == {
        "embed.weight": (10, 4),
        "norm.weight": (4,),
        "norm.bias": (4,),
        "fc.weight": (6, 4),
        "fc.bias": (6,),
    }


def test_nnx_state_names_equal_torch_module_names() -> None:
    class Net(nnx.Module):
        def __init__(self, rngs: nnx.Rngs) -> None:
            self.embed = nnx.Embed(10, 4, rngs=rngs)
            self.norm = nnx.LayerNorm(4, rngs=rngs)
            self.head = nnx.Linear(4, 6, rngs=rngs)

    class TorchNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)
            self.norm = nn.LayerNorm(4)
            self.head = nn.Linear(4, 6)

    flax_state = nnx.state(Net(nnx.Rngs(0)), nnx.Param)
    torch_net = TorchNet()
    registration = [name for name, _ in torch_net.named_parameters()]
    # Same names and layouts, no renames needed; the natural order is alphabetical here
    # (embed, head, norm), not torch's registration order, so the order is passed.
    assert [s.name for s in torch_specs(flax_state)][1:3] == ["head.weight", "head.bias"]
    assert torch_specs(flax_state, order=registration) == param_specs(torch_net)
    # state round trip through torch
    torch_net.load_state_dict(
        {k: torch.from_numpy(v) for k, v in to_torch_state(flax_state).items()}
    )
    back = from_torch_state(torch_net.state_dict(), flax_state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(flax_state), strict=True):
        np.testing.assert_array_equal(a, b)


def test_renames_order_and_errors() -> None:
    tree = {"params": {"Dense_0": _dense(2, 3), "Dense_1": _dense(3, 1)}}
    renames = {"Dense_0": "encoder.fc", "Dense_1": "head"}
    assert torch_name("params/Dense_0/kernel", modules=renames) == "encoder.fc.weight"
    assert torch_name("params/Block_0/Dense_1/bias", modules={"Block_0": "blocks.0"}) == (
        "blocks.0.Dense_1.bias"
    )
    # Longest prefix wins.
    longest = {"Block_0": "blocks.0", "Block_0/Dense_1": "blocks.0.out"}
    assert torch_name("params/Block_0/Dense_1/bias", modules=longest) == "blocks.0.out.bias"
    order = ["head.weight", "head.bias", "encoder.fc.weight", "encoder.fc.bias"]
    specs = torch_specs(tree, modules=renames, order=order)
    assert [s.name for s in specs] == order
    assert specs[0] == ParamSpec(name="head.weight", shape=(1, 3))
    with pytest.raises(ValueError, match="order must list every torch name once"):
        torch_specs(tree, modules=renames, order=order[:3])
    with pytest.raises(ValueError, match=r"two Flax parameters map to torch name 'x\.bias'"):
        torch_specs(tree, modules={"Dense_0": "x", "Dense_1": "x"})
    state = to_torch_state(tree, modules=renames)
    state["head.weight"] = np.zeros((3, 1), np.float32)  # transposed by mistake
    with pytest.raises(ValueError, match=r"'head\.weight' has torch shape \(3, 1\)"):
        from_torch_state(state, tree, modules=renames)


def test_both_spec_builders_use_one_device_tag(monkeypatch) -> None:
    """param_specs and torch_specs tag a device the same way on every backend (a TPU was
    'tpu' in one and 'cuda' in the other)."""
    from gradsync_jax import param_specs as flax_param_specs

    tree = {"params": {"Dense_0": _dense(2, 3)}}
    for backend, want in (("cpu", "cpu"), ("gpu", "cuda"), ("rocm", "cuda"), ("tpu", "tpu")):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        tags = {s.device for s in flax_param_specs(tree)} | {s.device for s in torch_specs(tree)}
        assert tags == {want}, backend
