"""gradsync_torch.DataParallel on gloo at world sizes 1, 2 and 4.

One spawn per world size runs every check of ``dp_grad_checks`` (gradients) and
``dp_setup_checks`` (buffers, broadcasts, mismatches, errors) in one process
group (spawns cost seconds); each check is then reported as its own test. References and
tolerances are stated in ``dp_grad_checks``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from torch import nn

import gradsync_torch as gt
from tests.support.harness import run_checks, run_workers
from tests.torch import dp_grad_checks as grad_checks
from tests.torch import dp_setup_checks as setup_checks

WORLD_SIZES = (1, 2, 4)
# name: (check, smallest world size where it means something)
CHECKS: dict[str, tuple[Callable[[int, int], None], int]] = {
    "matches_reference_and_ddp": (grad_checks.check_matches_reference_and_ddp, 1),
    "many_buckets_match_ddp": (grad_checks.check_many_buckets_match_ddp, 1),
    "legacy_equals_overlap": (grad_checks.check_legacy_equals_overlap, 1),
    "no_sync_accumulates": (grad_checks.check_no_sync_accumulates, 1),
    "unused_parameters": (grad_checks.check_unused_parameters, 1),
    "tied_and_frozen": (grad_checks.check_tied_and_frozen, 1),
    "compression": (grad_checks.check_compression, 1),
    "reduce_sum_and_groups": (grad_checks.check_reduce_sum_and_groups, 1),
    "batchnorm_buffers": (setup_checks.check_batchnorm_buffers, 1),
    "broadcasts": (setup_checks.check_broadcasts, 2),
    "mismatch_fails_fast": (setup_checks.check_mismatch_fails_fast, 2),
    "errors": (setup_checks.check_errors, 1),
    "gradient_sharder_link": (setup_checks.check_gradient_sharder_link, 1),
}


def run_all(rank: int, ws: int) -> dict[str, str | None]:
    """Run every check that applies to ``ws``; name -> None (passed) or a traceback
    (``harness.run_checks``: agreed across ranks, later checks not run after a failure)."""
    torch.manual_seed(0)
    return run_checks(
        (name, functools.partial(check, rank, ws))
        for name, (check, min_ws) in CHECKS.items()
        if ws >= min_ws
    )


_results: dict[int, list[dict[str, str | None]]] = {}


def _outcomes(world_size: int) -> list[dict[str, str | None]]:
    if world_size not in _results:
        _results[world_size] = run_workers(run_all, world_size, timeout=240)
    return _results[world_size]


@pytest.mark.parametrize(
    ("world_size", "check"),
    [
        pytest.param(ws, name, marks=[pytest.mark.slow] if ws != 2 else [])
        for ws in WORLD_SIZES
        for name, (_, min_ws) in CHECKS.items()
        if ws >= min_ws
    ],
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
