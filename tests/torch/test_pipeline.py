"""gradsync_torch's pipeline executor on gloo at pp 2 and 4 (docs/pipeline.md).

One spawn per world size runs every check of ``pipeline_checks`` in one process group
(spawns cost seconds); each check is then reported as its own test. References and
tolerances are stated in ``pipeline_checks``. World size 2 (pp 2: every schedule against
torch's, a tied embedding, the refusals and failures) is the fast representative; world size
4 (pp 4, dp 2 x pp 2, ZeRO-3 x pp 2, tp 2 x pp 2) is marked slow.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from gradsync_core import Topology, plan_pipeline
from tests.support.harness import run_checks, run_workers
from tests.torch import pipeline_checks as checks

# name: (check, the world sizes it runs at)
CHECKS: dict[str, tuple[Callable[[int, int], None], tuple[int, ...]]] = {
    "schedules_equal_torch": (checks.check_schedules_equal_torch, (2, 4)),
    "timeline": (checks.check_timeline, (2,)),
    "tied_embedding": (checks.check_tied_embedding, (2,)),
    "refusals": (checks.check_refusals, (2,)),
    "failures": (checks.check_failures, (2,)),
    "data_parallel": (checks.check_data_parallel, (4,)),
    "zero3": (checks.check_zero3, (4,)),
    "tensor_parallel": (checks.check_tensor_parallel, (4,)),
    "checkpoint": (checks.check_checkpoint, (4,)),
}


def run_all(rank: int, ws: int, directory: str) -> dict[str, str | None]:
    return run_checks(
        (name, functools.partial(check, rank, ws, *([directory] if name == "checkpoint" else [])))
        for name, (check, sizes) in CHECKS.items()
        if ws in sizes
    )


_results: dict[int, list[dict[str, str | None]]] = {}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the checkpoint check saves (read again by the JAX test)."""
    return tmp_path_factory.mktemp("pipeline-checkpoints")


def _outcomes(world_size: int, directory: Path) -> list[dict[str, str | None]]:
    if world_size not in _results:
        _results[world_size] = run_workers(run_all, world_size, str(directory), timeout=300)
    return _results[world_size]


@pytest.mark.parametrize(
    ("world_size", "check"),
    [
        pytest.param(ws, name, marks=[pytest.mark.slow] if ws == 4 else [])
        for name, (_, sizes) in CHECKS.items()
        for ws in sizes
    ],
    ids=lambda v: f"ws{v}" if isinstance(v, int) else v,
)
def test_pipeline(world_size: int, check: str, checkpoints: Path) -> None:
    for rank, outcome in enumerate(_outcomes(world_size, checkpoints)):
        assert check in outcome, f"check {check} did not run on rank {rank}"
        error = outcome[check]
        assert error is None, f"rank {rank} of {world_size}: {error}"


def test_needs_an_initialized_process_group() -> None:
    from gradsync_torch.pipeline import Pipeline

    plan = plan_pipeline(schedule="GPipe", microbatches=2, topology=Topology(pp=2), layers=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Pipeline(plan, {0: nn.Linear(2, 2)}, groups=None, loss_fn=torch.nn.functional.mse_loss)


@pytest.mark.slow
def test_pipeline_checkpoint_loads_in_jax(checkpoints: Path) -> None:
    """The checkpoint saved at dp 2 x pp 2 (check ``checkpoint``) read by gradsync_jax into
    a Flax-shaped tree: the same numbers as torch's unpipelined model loads (kernels
    transposed, the tied table once)."""
    pytest.importorskip("jax")
    import jax
    import numpy as np

    from examples.pipeline_models import gpt_blocks
    from gradsync_jax import load_params
    from gradsync_torch import load_model_weights

    outcome = _outcomes(4, checkpoints)[0]["checkpoint"]
    assert outcome is None, outcome
    path = checkpoints / "tied"
    model = gpt_blocks(tied=True, seed=1)
    load_model_weights(path, model)
    like: dict = {}
    flax_leaf = {nn.Embedding: "embedding", nn.Linear: "kernel", nn.LayerNorm: "scale"}
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        kind = type(model.get_submodule(prefix))
        leaf = flax_leaf[kind] if leaf == "weight" else leaf
        shape = tuple(p.shape)[::-1] if leaf == "kernel" else tuple(p.shape)
        node = like.setdefault("params", {})
        for part in prefix.split("."):
            node = node.setdefault(part, {})
        node[leaf] = jax.ShapeDtypeStruct(shape, np.float32)
    params = load_params(path, like)
    for name, p in model.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        node = params["params"]
        for part in prefix.split("."):
            node = node[part]
        kind = type(model.get_submodule(prefix))
        value = np.asarray(node[flax_leaf[kind] if leaf == "weight" else leaf])
        want = p.detach().numpy()
        np.testing.assert_array_equal(
            value.T if kind is nn.Linear and leaf == "weight" else value, want
        )
