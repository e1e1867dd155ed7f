"""gradsync_torch.DataParallel on gloo at world sizes 1, 2 and 4.

One spawn per world size runs every check of ``test_data_parallel_checks`` (spawns cost
seconds); each check is then reported as its own test. Tolerances and references are stated
in that module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync_torch as gt
from tests.torch.harness import run_workers
from tests.torch.test_data_parallel_checks import CHECKS, run_checks

WORLD_SIZES = (1, 2, 4)
_results: dict[int, list[dict[str, str | None]]] = {}


def _outcomes(world_size: int) -> list[dict[str, str | None]]:
    if world_size not in _results:
        _results[world_size] = run_workers(run_checks, world_size, timeout=240)
    return _results[world_size]


@pytest.mark.parametrize(
    ("world_size", "check"),
    [(ws, name) for ws in WORLD_SIZES for name, (_, min_ws) in CHECKS.items() if ws >= min_ws],
    ids=lambda v: f"ws{v}" if isinstance(v, int) else v,
)
def test_data_parallel(world_size: int, check: str) -> None:
    for rank, outcome in enumerate(_outcomes(world_size)):
        assert check in outcome, f"check {check} did not run on rank {rank}"
        error = outcome[check]
        assert error is None, f"rank {rank} of {world_size}: {error}"


def test_needs_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        gt.DataParallel(nn.Linear(2, 2))


def test_grad_bucket_has_ddps_methods() -> None:
    buffer = torch.arange(6.0)
    param = nn.Parameter(torch.zeros(2, 3))
    bucket = gt.GradBucket(3, buffer, [buffer.view(2, 3)], [param], True)
    assert (bucket.index(), bucket.is_last()) == (3, True)
    assert bucket.buffer() is buffer and bucket.parameters()[0] is param
    assert torch.equal(bucket.gradients()[0], buffer.view(2, 3))
    for name in ("index", "buffer", "gradients", "parameters", "is_last", "set_buffer"):
        assert hasattr(torch.distributed.GradBucket, name), name
    bucket.set_buffer(torch.ones(6))
    assert torch.equal(bucket.buffer(), torch.ones(6))
