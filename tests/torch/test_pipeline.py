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

import pytest
import torch
from torch import nn

from gradsync_core import Topology, plan_pipeline
from tests.torch import pipeline_checks as checks
from tests.torch.harness import run_checks, run_workers

# name: (check, the world sizes it runs at)
CHECKS: dict[str, tuple[Callable[[int, int], None], tuple[int, ...]]] = {
    "schedules_equal_torch": (checks.check_schedules_equal_torch, (2, 4)),
    "tied_embedding": (checks.check_tied_embedding, (2,)),
    "refusals": (checks.check_refusals, (2,)),
    "failures": (checks.check_failures, (2,)),
    "data_parallel": (checks.check_data_parallel, (4,)),
    "zero3": (checks.check_zero3, (4,)),
    "tensor_parallel": (checks.check_tensor_parallel, (4,)),
}


def run_all(rank: int, ws: int) -> dict[str, str | None]:
    return run_checks(
        (name, functools.partial(check, rank, ws))
        for name, (check, sizes) in CHECKS.items()
        if ws in sizes
    )


_results: dict[int, list[dict[str, str | None]]] = {}


def _outcomes(world_size: int) -> list[dict[str, str | None]]:
    if world_size not in _results:
        _results[world_size] = run_workers(run_all, world_size, timeout=300)
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
def test_pipeline(world_size: int, check: str) -> None:
    for rank, outcome in enumerate(_outcomes(world_size)):
        assert check in outcome, f"check {check} did not run on rank {rank}"
        error = outcome[check]
        assert error is None, f"rank {rank} of {world_size}: {error}"


def test_needs_an_initialized_process_group() -> None:
    from gradsync_torch.pipeline import Pipeline

    plan = plan_pipeline(schedule="GPipe", microbatches=2, topology=Topology(pp=2), layers=2)
    with pytest.raises(RuntimeError, match="init_process_group"):
        Pipeline(plan, {0: nn.Linear(2, 2)}, groups=None, loss_fn=torch.nn.functional.mse_loss)
