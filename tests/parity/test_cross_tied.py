"""(d): a tied embedding and a frozen layer cross frameworks, weights and optimizer state.

torch ties ``head.weight`` to ``embed.weight`` (``named_parameters`` lists it once); the Flax
twin has one table and calls ``Embed.attend``. The frozen layer has no optimizer state on
either side (torch: ``requires_grad=False``; JAX: it is kept out of the tree given to
``shard_optimizer``) but its weights travel with the checkpoint. Tolerances as in
``test_cross_checkpoint.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradsync_jax import (
    load_optimizer_state,
    load_params,
    save_optimizer_state,
    shard_optimizer,
    to_torch_state,
)
from gradsync_torch import load_model_weights
from tests.parity import tied_worker
from tests.parity.mlp_twin import RTOL, TORCH_HYPER, jax_moments
from tests.parity.tied_twin import (
    RENAMES,
    adamw,
    data,
    joined,
    linen_init,
    split,
    train_jax,
)
from tests.parity.tied_worker import DIM, TiedLM
from tests.support.asserts import assert_close
from tests.support.harness import run_workers
from tests.support.meshes import mesh_of

pytestmark = pytest.mark.slow


def test_tied_frozen_torch_to_jax(tmp_path) -> None:
    """torch 2 ranks 5 steps, saved with weights -> JAX 4 devices 5 steps == torch 10 steps."""
    like = linen_init()
    init = to_torch_state(like, modules=RENAMES)
    assert "head.weight" not in init and "embed.weight" in init
    tokens, labels = data()
    path = str(tmp_path / "ckpt")
    torch_run = run_workers(
        tied_worker.run, 2, init, tokens, labels, TORCH_HYPER["adamw"], 10, 5, path, None
    )[0]
    trainable, frozen = split(load_params(path, like, modules=RENAMES))
    tx = shard_optimizer(adamw(), mesh_of(4), partition="greedy")
    opt_state, manifest = load_optimizer_state(path, tx, trainable, modules=RENAMES)
    assert "frozen.weight" not in manifest.state_keys
    trainable, opt_state = train_jax(tx, trainable, frozen, opt_state, 5)
    got = to_torch_state(joined(trainable, frozen), modules=RENAMES)
    worst = assert_close(got, torch_run["params"], RTOL["params"], "params")
    worst = max(
        worst,
        assert_close(
            jax_moments(tx, opt_state, trainable, "adamw", RENAMES),
            torch_run["state"],
            RTOL["state"],
            "state",
        ),
    )
    np.testing.assert_array_equal(got["frozen.weight"], init["frozen.weight"])
    print(f"tied/frozen torch -> JAX: worst relative error {worst:.2e}")


def test_tied_frozen_jax_to_torch(tmp_path) -> None:
    """JAX 8 devices 5 steps, saved with weights -> torch 3 ranks (weights from the
    checkpoint, not its own init) 5 steps == JAX 10 steps."""
    trainable, frozen = split(linen_init())
    tx = shard_optimizer(adamw(), mesh_of(8), partition="greedy")
    trainable, state5 = train_jax(tx, trainable, frozen, tx.init(trainable), 5)
    path = str(tmp_path / "ckpt")
    model = joined(trainable, frozen)
    save_optimizer_state(path, tx, state5, trainable, step=5, modules=RENAMES, model=model)
    want_params = to_torch_state(model, modules=RENAMES)
    trainable10, state10 = train_jax(tx, trainable, frozen, state5, 5)
    tokens, labels = data()
    torch_run = run_workers(
        tied_worker.run, 3, None, tokens, labels, TORCH_HYPER["adamw"], 5, None, None, path
    )[0]
    want = to_torch_state(joined(trainable10, frozen), modules=RENAMES)
    worst = assert_close(torch_run["params"], want, RTOL["params"], "params")
    moments = jax_moments(tx, state10, trainable10, "adamw", RENAMES)
    worst = max(worst, assert_close(torch_run["state"], moments, RTOL["state"], "state"))
    assert set(torch_run["steps"].values()) == {10.0}
    # Weights alone, without a process group: into a module, as evaluation would.
    net = TiedLM()
    load_model_weights(path, net)
    assert net.head.weight is net.embed.weight
    for name, param in net.named_parameters():
        np.testing.assert_array_equal(param.detach().numpy(), want_params[name])
    print(f"tied/frozen JAX -> torch: worst relative error {worst:.2e}")


def test_mismatched_weights_are_refused_and_nothing_changes(tmp_path) -> None:
    variables = linen_init()
    trainable, _ = split(variables)
    tx = shard_optimizer(adamw(), mesh_of(2), partition="greedy")
    path = str(tmp_path / "ckpt")
    save_optimizer_state(
        path, tx, tx.init(trainable), trainable, step=0, modules=RENAMES, model=variables
    )
    net = TiedLM()
    net.layers.append(torch.nn.Linear(DIM, DIM))
    before = {n: p.detach().clone() for n, p in net.named_parameters()}
    with pytest.raises(ValueError, match=r"lacks 'layers.3.bias' \(2 missing, 0 unexpected\)"):
        load_model_weights(path, net)
    assert all(torch.equal(p, before[n]) for n, p in net.named_parameters())
    with pytest.raises(ValueError, match=r"has 'frozen.bias', unknown here"):
        load_params(path, trainable, modules=RENAMES)
    with pytest.raises(ValueError, match=r"lacks 'layers_0.bias'"):
        load_params(path, variables)  # without the renames used at save time
    no_weights = str(tmp_path / "state-only")
    save_optimizer_state(no_weights, tx, tx.init(trainable), trainable, step=0, modules=RENAMES)
    with pytest.raises(ValueError, match="holds no model weights; save it with"):
        load_params(no_weights, variables, modules=RENAMES)
