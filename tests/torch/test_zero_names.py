"""``ZeroRedundancyOptimizer`` built without parameter names says at construction that saving
will need ``model=``, instead of failing at the first save after the training time is spent
(docs/torch-zero.md, "Checkpoints and resharding"). One process, a world of one."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradsync_torch import DataParallel, ZeroRedundancyOptimizer
from tests.support.harness import one_rank_group

UNNAMED = (
    r"without names .* opt\.save\(\) and opt\.load\(\) will need model=.*"
    r"model\.named_parameters\(\)"
)


@pytest.fixture(scope="module")
def process_group():
    with one_rank_group():
        yield


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_unnamed_parameters_warn_once_at_construction(process_group, tmp_path) -> None:
    model = net()
    with pytest.warns(UserWarning, match=UNNAMED) as caught:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=0.1)
    assert len([w for w in caught if issubclass(w.category, UserWarning)]) == 1
    assert caught[0].filename == __file__  # points at the user's line
    with pytest.raises(ValueError, match=r"pass model=<the module> to save/load"):
        opt.save(tmp_path / "c")
    opt.save(tmp_path / "c", model=model)  # what the warning says works


@pytest.mark.parametrize("how", ["named", "groups", "zero2-wrapper"])
def test_names_known_no_warning(process_group, tmp_path, how: str) -> None:
    """``named_parameters()`` (the README's and docs' examples), named param groups, and ZeRO-2
    through ``DataParallel`` (the wrapper knows its module's names) need no ``model=``."""
    model = net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        if how == "named":
            opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.AdamW, lr=0.1)
        elif how == "groups":
            named = list(model.named_parameters())
            groups = [{"params": [p for _, p in named], "param_names": [n for n, _ in named]}]
            opt = ZeroRedundancyOptimizer(groups, torch.optim.AdamW, lr=0.1)
        else:
            wrapper = DataParallel(model, shard_gradients=True)
            opt = ZeroRedundancyOptimizer(
                model.parameters(),
                torch.optim.AdamW,
                lr=0.1,
                shard_gradients=True,
                data_parallel=wrapper,
            )
    assert opt.param_names() == ["0.weight", "0.bias", "2.weight", "2.bias"]
    opt.save(tmp_path / how)
    opt.load(tmp_path / how)
