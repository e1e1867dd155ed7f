"""``DataParallel(check_finite=True)`` names the rank(s) and parameter(s) of a non-finite
gradient, on every rank, and changes nothing on the good path (issue 21, item 6).

One 2-rank spawn runs every check: a NaN from one rank, an inf from both, the same bits as
without the check when every gradient is finite, recovery after the error, legacy mode, and
the refused combination with ZeRO-2.
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.distributed as dist
from torch import nn

import gradsync_torch as gt
from tests.support.harness import run_checks, run_workers
from tests.torch.dp_grad_checks import batch, expect_error, grads, mlp, shard

WORLD = 2
NAN, INF = float("nan"), float("inf")


def _step(model: nn.Module, rank: int, poison: float | None = None, *, legacy: bool = False):
    """One forward and backward on this rank's shard; ``poison`` is added to the gradient of
    the middle layer's weight (``2.weight``) on this rank only."""
    x, y = batch(0, WORLD)
    loss = nn.functional.mse_loss(model(shard(x, rank)), shard(y, rank))
    if poison is not None:
        loss = loss + (model.module[2].weight * poison).sum()
    model.zero_grad(set_to_none=True)
    loss.backward()
    if legacy:
        model.sync_gradients()


def _check_names_the_rank_and_parameter(rank: int) -> None:
    model = gt.DataParallel(mlp(), check_finite=True, bucket_cap_mb=0.0001)  # many buckets
    poison = NAN if rank == 1 else None
    text = expect_error(
        FloatingPointError,
        ["rank(s) [1] sent non-finite gradients", "'2.weight'", "after sync"],
        lambda: _step(model, rank, poison),
    )
    assert "'0.weight'" not in text, text  # its bucket stayed finite
    _step(model, rank)  # the next, finite step goes on as usual
    assert all(bool(torch.isfinite(g).all()) for g in grads(model))
    expect_error(
        FloatingPointError,
        ["rank(s) [0, 1] sent non-finite gradients", "'2.weight'"],
        lambda: _step(model, rank, INF * (rank + 1)),  # inf on both: the sum too
    )


def _check_good_path_is_bitwise_unchanged(rank: int) -> None:
    base = mlp()
    plain = gt.DataParallel(copy.deepcopy(base))
    checked = gt.DataParallel(copy.deepcopy(base), check_finite=True)
    for _ in range(2):
        _step(plain, rank)
        _step(checked, rank)
    for a, b in zip(grads(plain), grads(checked), strict=True):
        assert torch.equal(a, b)


def _check_legacy_mode(rank: int) -> None:
    model = gt.DataParallel(mlp(), check_finite=True, overlap=False)
    expect_error(
        FloatingPointError,
        ["rank(s) [0] sent non-finite gradients", "'2.weight'"],
        lambda: _step(model, rank, INF if rank == 0 else None, legacy=True),
    )
    _step(model, rank, legacy=True)


def _check_refused_with_zero2(rank: int) -> None:
    expect_error(
        ValueError,
        ["check_finite=True", "shard_gradients=True", "use one or the other"],
        lambda: gt.DataParallel(mlp(), check_finite=True, shard_gradients=True),
    )
    dist.barrier()


def _checks(rank: int, world_size: int) -> dict[str, str | None]:
    checks = {
        "names the rank and the parameter": _check_names_the_rank_and_parameter,
        "good path bitwise unchanged": _check_good_path_is_bitwise_unchanged,
        "legacy mode": _check_legacy_mode,
        "refused with ZeRO-2": _check_refused_with_zero2,
    }
    return run_checks((name, functools.partial(check, rank)) for name, check in checks.items())


def test_check_finite_names_rank_and_parameter() -> None:
    for results in run_workers(_checks, WORLD, timeout=120):
        failed = {name: err for name, err in results.items() if err is not None}
        assert not failed, failed
