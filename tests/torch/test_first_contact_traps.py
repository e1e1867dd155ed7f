"""Traps a new user falls into with torch checkpoints (issue 22 item 4), one process."""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch
from torch import nn

from gradsync_torch import DataParallel, ZeroRedundancyOptimizer, load_model_weights
from tests.support.harness import one_rank_group


@pytest.fixture(scope="module")
def process_group():
    with one_rank_group():
        yield


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def trained(path, *, wrapped_params: bool, wrapped_model: bool) -> nn.Module:
    inner = net()
    model = DataParallel(inner)
    named = (model if wrapped_params else inner).named_parameters()
    opt = ZeroRedundancyOptimizer(named, torch.optim.AdamW, lr=0.1)
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    opt.save(path, model=model if wrapped_model else inner)
    return inner


def stored_names(path) -> set[str]:
    with open(os.path.join(path, "manifest.json")) as f:
        manifest = json.load(f)
    return set(manifest["extra"]["model"]) | {p["name"] for p in manifest["params"]}


@pytest.mark.parametrize(
    "wrapped_params, wrapped_model",
    [(True, True), (True, False), (False, True)],
    ids=["wrapper-both", "wrapper-params", "wrapper-model"],
)
def test_a_wrapper_stores_its_models_names(process_group, tmp_path, wrapped_params, wrapped_model):
    inner = trained(tmp_path / "c", wrapped_params=wrapped_params, wrapped_model=wrapped_model)
    assert stored_names(tmp_path / "c") == {"0.weight", "0.bias", "2.weight", "2.bias"}
    for target in (net(), DataParallel(net())):  # the bare model, and a wrapper's model.module
        load_model_weights(tmp_path / "c", target)
        inside = target.module if isinstance(target, DataParallel) else target
        for a, b in zip(inside.parameters(), inner.parameters(), strict=True):
            assert torch.equal(a, b)
    opt = ZeroRedundancyOptimizer(DataParallel(net()).named_parameters(), torch.optim.AdamW)
    opt.load(tmp_path / "c", model=DataParallel(net()))


def test_dtype_only_mismatch_says_dtype_and_casts_when_asked(process_group, tmp_path):
    inner = trained(tmp_path / "c", wrapped_params=False, wrapped_model=False)
    half = net().to(torch.bfloat16)
    with pytest.raises(
        ValueError,
        match=r"bfloat16 here .*only the dtype differs; pass allow_dtype_conversion=True",
    ):
        load_model_weights(tmp_path / "c", half)
    assert all(p.dtype == torch.bfloat16 for p in half.parameters())
    load_model_weights(tmp_path / "c", half, allow_dtype_conversion=True)
    for a, b in zip(half.parameters(), inner.parameters(), strict=True):
        assert torch.equal(a, b.to(torch.bfloat16))
    # and back: the bfloat16 model saved, loaded into float32 parameters
    opt = ZeroRedundancyOptimizer(half.named_parameters(), torch.optim.SGD, lr=0.1)
    opt.save(tmp_path / "h", model=half)
    full = net()
    with pytest.raises(ValueError, match="only the dtype differs"):
        load_model_weights(tmp_path / "h", full)
    load_model_weights(tmp_path / "h", full, allow_dtype_conversion=True)
    for a, b in zip(full.parameters(), half.parameters(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float())
    other = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 2))
    with pytest.raises(ValueError, match="another model"):
        load_model_weights(tmp_path / "c", other, allow_dtype_conversion=True)


def test_name_mismatch_names_both_sides(process_group, tmp_path):
    trained(tmp_path / "c", wrapped_params=False, wrapped_model=False)
    renamed = nn.Sequential()
    renamed.add_module("0", nn.Linear(4, 8))
    renamed.add_module("1", nn.ReLU())
    renamed.add_module("out", nn.Linear(8, 2))
    with pytest.raises(ValueError, match=r"lacks 'out.bias'.*checkpoint's unmatched names .*'2."):
        load_model_weights(tmp_path / "c", renamed)


def test_checkpoint_files_respect_the_umask(process_group, tmp_path):
    old = os.umask(0o022)
    try:
        trained(tmp_path / "c", wrapped_params=False, wrapped_model=False)
        os.umask(0o027)
        trained(tmp_path / "d", wrapped_params=False, wrapped_model=False)
    finally:
        os.umask(old)
    for directory, mode in ((tmp_path / "c", 0o644), (tmp_path / "d", 0o640)):
        files = os.listdir(directory)
        assert "manifest.json" in files and len(files) >= 2
        for name in files:
            assert stat.S_IMODE(os.stat(directory / name).st_mode) == mode, name
