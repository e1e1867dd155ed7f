"""The one cross-rank agreement primitive (gradsync_torch.agreement): silent when every rank
agrees, the same sentence on every rank when one differs."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.support.harness import run_workers  # noqa: E402


def _agree_on(rank: int, world_size: int, odd_rank: int | None) -> str | None:
    from gradsync_torch.agreement import agree_on

    payload = {"lr": 0.1 if rank != odd_rank else 0.2, "names": ["a", "b"]}
    try:
        agree_on(
            payload,
            None,
            describe=lambda d: (
                f"ranks {d.agreeing} vs {d.differing}: lr {d.base['lr']} on rank "
                f"{d.base_rank} vs {d.other['lr']} on rank {d.other_rank}"
            ),
        )
    except ValueError as e:
        return str(e)
    return None


def _agree_ok(rank: int, world_size: int, failing: set[int]) -> str | None:
    from gradsync_torch.agreement import agree_ok

    try:
        agree_ok(f"disk full on {rank}" if rank in failing else None, None, what="cannot save")
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_agree_on_is_silent_when_equal_and_names_both_sides_when_not():
    assert run_workers(_agree_on, 3, None) == [None, None, None]
    messages = run_workers(_agree_on, 3, 2)
    assert messages == ["ranks [0, 1] vs [2]: lr 0.1 on rank 0 vs 0.2 on rank 2"] * 3


def test_agree_ok_raises_the_first_failure_on_every_rank():
    assert run_workers(_agree_ok, 2, set()) == [None, None]
    assert run_workers(_agree_ok, 2, {1}) == ["cannot save (rank 1): disk full on 1"] * 2


def _zero_plans(rank: int, world_size: int, odd_rank: int | None) -> str | None:
    import torch

    from gradsync_torch import ZeroRedundancyOptimizer

    width = 5 if rank == odd_rank else 4
    params = [("w", torch.nn.Parameter(torch.zeros(width, 3)))]
    try:
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.slow
def test_zero_plans_agree_through_the_primitive():
    """ZeroRedundancyOptimizer's plan check (``check_same_plan``) rides on ``agree_on``: the
    fingerprint's digest first, the parameter tables only to name the difference."""
    assert run_workers(_zero_plans, 2, None) == [None, None]
    expected = (
        "ranks 0 and 1 built different ZeRO plans (parameter #0: ('w', (4, 3), 'float32', "
        "True) vs ('w', (5, 3), 'float32', True)); every rank must pass the same parameters, "
        "in the same order, with the same requires_grad"
    )
    assert run_workers(_zero_plans, 2, 1) == [expected, expected]
