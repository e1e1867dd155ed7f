"""Matrix optimizers across the two executors: one rule, one owner plan (docs/matrix-optimizers.md).

- The kinds: for every optimizer both frameworks have, the core's kind
  (``gradsync_core.plan.optimizer_kind``, which torch's refusals read) is what JAX's jaxpr
  analysis proves about the Optax version under ``shard_optimizer``: ``elementwise`` runs
  ``partition="flat"``, ``per_tensor`` is refused by flat and runs ``"greedy"`` (whole tensors),
  ``coupled`` is refused by both.
- The owners: torch's ``MatrixOptimizer`` around ``torch.optim.Muon`` (4 gloo ranks) and JAX's
  ``shard_optimizer(optax.contrib.muon)`` (4 devices) plan the same owners for the same GPT:
  the same ``MatrixOwnerPlan``, fingerprint for fingerprint.

Trajectories are not compared across frameworks: ``torch.optim.Muon`` runs Newton-Schulz in
bfloat16 on an uncorrected momentum, ``optax.contrib.muon`` in float32 on a bias-corrected
one; they are two optimizers (docs/matrix-optimizers.md, "Torch and JAX").
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import optax.contrib
import pytest

from gradsync_core import Topology
from gradsync_core.plan import optimizer_kind
from gradsync_jax import mesh_from_topology, shard_optimizer
from tests.jax.muon_problem import gpt_params, muon
from tests.support.harness import run_workers

# Canonical optimizer -> its Optax version, for each optimizer both frameworks have.
OPTAX = {
    "sgd": lambda: optax.sgd(1e-2),
    "sgd_momentum": lambda: optax.sgd(1e-2, momentum=0.9),
    "adam": lambda: optax.adam(1e-2),
    "adamw": lambda: optax.adamw(1e-2),
    "adamax": lambda: optax.adamax(1e-2),
    "nadam": lambda: optax.nadam(1e-2),
    "radam": lambda: optax.radam(1e-2),
    "rmsprop": lambda: optax.rmsprop(1e-2),
    "adagrad": lambda: optax.adagrad(1e-2),
    "adadelta": lambda: optax.adadelta(1e-2),
    "lion": lambda: optax.lion(1e-3),
    "muon": lambda: optax.contrib.muon(1e-2),
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=2),
    "lbfgs": lambda: optax.lbfgs(1e-2),
}
SAMPLE = {
    "w": jax.ShapeDtypeStruct((6, 4), np.float32),
    "b": jax.ShapeDtypeStruct((4,), np.float32),
}


def jax_kind(tx: optax.GradientTransformation) -> str:
    """What shard_optimizer's analysis proves: the partitions it accepts on a sample tree."""
    mesh = mesh_from_topology(Topology.create(2), devices=jax.devices()[:2])

    def accepts(partition: str) -> bool:
        try:
            shard_optimizer(tx, mesh, partition=partition).layout(SAMPLE)
        except ValueError:
            return False
        return True

    if accepts("flat"):
        return "elementwise"
    return "per_tensor" if accepts("greedy") else "coupled"


@pytest.mark.parametrize("name", sorted(OPTAX))
def test_the_core_kind_is_what_the_jax_analysis_proves(name: str) -> None:
    assert jax_kind(OPTAX[name]()) == optimizer_kind(name)


def torch_plan(rank: int, world_size: int) -> dict | None:
    import torch

    from examples.pipeline_models import gpt_blocks
    from gradsync_torch import MatrixOptimizer
    from tests.torch.matrix_checks import split

    model = gpt_blocks(layers=2, width=16, heads=2, vocab=32, seq=8)
    muon = MatrixOptimizer(torch.optim.Muon(split(model)[0], lr=0.02))
    return muon.owner_plan.to_json() if rank == 0 else None


def test_torch_and_jax_plan_the_same_owners() -> None:
    torch_json = run_workers(torch_plan, 4, timeout=120)[0]
    mesh = mesh_from_topology(Topology.create(4), devices=jax.devices()[:4])
    jax_plan = shard_optimizer(muon(), mesh).matrix_plan(gpt_params())
    assert jax_plan is not None
    assert jax_plan.to_json() == torch_json


def torch_save(rank: int, world_size: int, path: str) -> None:
    from tests.torch.matrix_checks import build, train

    run = build("zero1", world_size)
    train(run, range(2), rank, world_size)
    run["muon"].save(path)


@pytest.mark.slow
def test_a_torch_muon_checkpoint_is_refused_by_optax_muon(tmp_path) -> None:
    """Not counterparts (two optimizers, module docstring): JAX refuses the torch file with
    the counterparts sentence rather than load a momentum into another algorithm."""
    from gradsync_jax import load_optimizer_state

    run_workers(torch_save, 2, str(tmp_path / "muon"), timeout=120)
    mesh = mesh_from_topology(Topology.create(2), devices=jax.devices()[:2])
    with pytest.raises(ValueError, match=r"'torch.optim.Muon' \(torch\) has no counterpart"):
        load_optimizer_state(tmp_path / "muon", shard_optimizer(muon(), mesh), gpt_params())
