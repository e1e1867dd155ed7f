"""A checkpoint that crosses frameworks says when the optimizer it loads into has other
hyper-parameters (issue 33, item 8; docs/checkpoints.md, "Hyper-parameters across frameworks").

torch keeps the hyper-parameters in the optimizer's param groups, which the manifest records;
Optax keeps them in the transformation, which JAX's load cannot change. So a torch AdamW
checkpoint (weight decay 0.01, torch's default) loaded into ``optax.adamw(1e-3)`` (1e-4,
Optax's default) would continue with a hundredth of the decay, silently. The load warns
(``gradsync_core.HyperparameterWarning``) naming each difference, in both directions; the
Optax side's values are what its transformation computes (probed), so a plain ``optax.adamw``
closure is checked too. Same values: no warning.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import optax
import pytest
import torch
from torch import nn

from gradsync_core import HyperparameterWarning
from gradsync_jax import load_optimizer_state, save_optimizer_state, shard_optimizer
from gradsync_torch import load_optimizer_state_dict
from gradsync_torch.checkpoint.plain_save import save_plain
from tests.support.meshes import mesh_of


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(6, 10)
        self.head = nn.Linear(10, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.dense(x)))


PARAMS = {
    "dense": {"kernel": jnp.ones((6, 10)), "bias": jnp.zeros((10,))},
    "head": {"kernel": jnp.ones((10, 3)), "bias": jnp.zeros((3,))},
}


def _torch_saved(path, make) -> None:
    torch.manual_seed(0)
    net = Net()
    opt = make(net)
    for _ in range(3):
        opt.zero_grad()
        net(torch.ones(4, 6)).square().mean().backward()
        opt.step()
    save_plain(path, net, opt)


def _loads_quietly(load) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", HyperparameterWarning)
        load()


def test_torch_adamw_into_optax(tmp_path) -> None:
    path = tmp_path / "ckpt"
    _torch_saved(path, lambda net: torch.optim.AdamW(net.parameters(), lr=1e-3))
    # Optax's default weight decay is 1e-4, torch's 0.01: said, in one warning per load.
    with pytest.warns(HyperparameterWarning) as caught:
        load_optimizer_state(path, optax.adamw(1e-3), PARAMS)
    (message,) = [str(w.message) for w in caught]
    assert "weight_decay 0.01 in the checkpoint, 0.0001 here" in message, message
    assert message.count(" in the checkpoint, ") == 1, message  # the learning rate is the same
    with pytest.warns(HyperparameterWarning, match=r"lr 0\.001 in the checkpoint, 0\.002 here"):
        load_optimizer_state(path, optax.adamw(2e-3, weight_decay=0.01), PARAMS)
    with pytest.warns(HyperparameterWarning, match=r"betas \(0\.9, 0\.999\) in the checkpoint"):
        load_optimizer_state(path, optax.adamw(1e-3, b2=0.95, weight_decay=0.01), PARAMS)
    sharded = shard_optimizer(optax.adamw(1e-3), mesh_of(2))  # ZeRO: the inner one is probed
    with pytest.warns(HyperparameterWarning, match=r"weight_decay 0\.01 in the checkpoint"):
        load_optimizer_state(path, sharded, PARAMS)
    _loads_quietly(lambda: load_optimizer_state(path, optax.adamw(1e-3, weight_decay=0.01), PARAMS))


def test_torch_param_groups_and_sgd_into_optax(tmp_path) -> None:
    path = tmp_path / "groups"
    _torch_saved(
        path,
        lambda net: torch.optim.AdamW(
            [
                {"params": net.dense.parameters()},
                {"params": net.head.parameters(), "weight_decay": 0.0},  # nanoGPT's no-decay group
            ],
            lr=1e-3,
            weight_decay=0.1,
        ),
    )
    with pytest.warns(HyperparameterWarning) as caught:
        load_optimizer_state(path, optax.adamw(1e-3, weight_decay=0.1), PARAMS)
    (message,) = [str(w.message) for w in caught]
    assert "param group 1: weight_decay 0 in the checkpoint, 0.1 here" in message, message
    assert "param group 0" not in message, message

    path = tmp_path / "sgd"
    _torch_saved(path, lambda net: torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9))
    with pytest.warns(HyperparameterWarning, match=r"momentum 0\.9 in the checkpoint, 0\.5 here"):
        load_optimizer_state(path, optax.sgd(0.1, momentum=0.5), PARAMS)
    _loads_quietly(lambda: load_optimizer_state(path, optax.sgd(0.1, momentum=0.9), PARAMS))


def test_optax_into_torch(tmp_path) -> None:
    path = tmp_path / "jax"
    tx = shard_optimizer(optax.adamw(1e-3), mesh_of(2))
    save_optimizer_state(path, tx, tx.init(PARAMS), PARAMS, step=0)
    net = Net()
    with pytest.warns(HyperparameterWarning) as caught:
        load_optimizer_state_dict(path, torch.optim.AdamW(net.parameters(), lr=1e-3), net)
    (message,) = [str(w.message) for w in caught]
    assert "weight_decay 0.0001 in the checkpoint, 0.01 here" in message, message
    quiet = torch.optim.AdamW(net.parameters(), lr=1e-3, weight_decay=1e-4)
    _loads_quietly(lambda: load_optimizer_state_dict(path, quiet, net))
