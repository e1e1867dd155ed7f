"""Weight-only loads refuse NaN/inf weights unless asked (issue 21, item 4): a NaN-filled
weight loads today and the model is NaN at once; ``load_model_weights`` (torch) and
``load_params`` (JAX) refuse it like the optimizer loads do, and ``allow_nonfinite=True``
takes it as it is."""

from __future__ import annotations

import math
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
import torch

from gradsync_jax import load_params, save_optimizer_state
from gradsync_torch import load_model_weights
from tests.faults import jax_save_worker as worker


class _Net(torch.nn.Module):
    """The torch twin of ``jax_save_worker.problem()``'s parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.dense = torch.nn.Linear(6, 10)
        self.head = torch.nn.Linear(10, 3)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_weight_loads_refuse_nonfinite_weights(tmp_path: Path, bad: float) -> None:
    tx, params = worker.problem()
    weights = jax.tree.map(jnp.ones_like, params)
    weights["head"]["bias"] = weights["head"]["bias"].at[1].set(bad)
    path = tmp_path / "ckpt"
    save_optimizer_state(path, tx, tx.init(weights), weights, step=1, model=weights)

    with pytest.raises(ValueError, match=r"'__model__/head\.bias' holds 1 NaN or infinite"):
        load_params(path, params)
    loaded = load_params(path, params, allow_nonfinite=True)
    assert not bool(jnp.isfinite(loaded["head"]["bias"][1]))

    net = _Net()
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with pytest.raises(
        ValueError,
        match=r"weight 'head\.bias' holds 1 NaN or infinite value\(s\).*"
        r"allow_nonfinite=True",
    ):
        load_model_weights(path, net)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())  # unchanged
    load_model_weights(path, net, allow_nonfinite=True)
    assert not bool(torch.isfinite(net.head.bias[1])) and bool((net.dense.weight == 1).all())
