"""The torch executor's renamed keywords and its options record (docs/design.md §13).

``load_model_weights(cast=)`` is ``allow_dtype_conversion=``: the same weights, one
``DeprecationWarning``. ``DataParallel(module, options=DataParallelOptions(...))`` is the
wrapper its keywords make, bitwise across two gloo ranks; the record and a keyword at once
are refused before any collective.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import nn

from gradsync_torch import (
    DataParallel,
    DataParallelOptions,
    ZeroRedundancyOptimizer,
    load_model_weights,
)
from tests.support.harness import one_rank_group, run_workers


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_cast_is_allow_dtype_conversion_and_warns_once(tmp_path, deprecations):
    with one_rank_group():
        model = net()
        opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.SGD, lr=0.1)
        opt.save(tmp_path / "c", model=model)
    new, old = net().to(torch.bfloat16), net().to(torch.bfloat16)
    torch.manual_seed(1)
    for p in (*new.parameters(), *old.parameters()):  # both differ from what is loaded
        p.data.normal_()
    load_model_weights(tmp_path / "c", new, allow_dtype_conversion=True)
    assert deprecations.messages == []
    for _ in range(2):
        load_model_weights(tmp_path / "c", old, cast=True)
    for a, b, want in zip(new.parameters(), old.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b) and torch.equal(a, want.to(torch.bfloat16))
    assert deprecations.messages == [
        "load_model_weights(cast=) is deprecated and will be removed: use "
        "load_model_weights(allow_dtype_conversion=)"
    ]
    with pytest.raises(TypeError, match="allow_dtype_conversion= and its deprecated spelling"):
        load_model_weights(tmp_path / "c", old, cast=True, allow_dtype_conversion=True)


OPTIONS = {"bucket_cap_mb": 0.0001, "reduce": "sum", "check_finite": True}


def _train(rank: int, world_size: int) -> int:
    """Two steps per way of passing the options (keywords, record): the same gradients."""
    grads = []
    for options in (OPTIONS, {"options": DataParallelOptions(**OPTIONS)}):
        model = DataParallel(net(), **options)
        assert model.options == DataParallelOptions(**OPTIONS)
        assert len(model.bucket_plan.buckets) > 1  # the tiny cap is in force
        torch.manual_seed(rank)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads, strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(grads[0][0], torch.zeros_like(grads[0][0]))
    with pytest.raises(TypeError, match=r"got options= and reduce=, which it also holds"):
        DataParallel(net(), options=DataParallelOptions(), reduce="sum")
    return len(grads[0])


def test_options_as_a_record_are_the_keywords_bitwise():
    assert run_workers(_train, 2) == [4, 4]


def test_a_record_with_its_fields_is_refused_before_any_collective():
    """No process group at all: the refusal comes first, in one sentence."""
    record = DataParallelOptions(overlap=False)
    with pytest.raises(TypeError) as err:
        DataParallel(net(), options=record, overlap=False, broadcast_buffers=True)
    assert str(err.value) == (
        "DataParallel() got options= and broadcast_buffers=, overlap=, which it also holds; "
        "pass the options in one place: the keywords alone, or "
        "options=dataclasses.replace(options, broadcast_buffers=...)"
    )
    assert dataclasses.replace(record, broadcast_buffers=False).overlap is False
    with pytest.raises(TypeError, match="options must be a DataParallelOptions, got dict"):
        DataParallel(net(), options={"overlap": False})
