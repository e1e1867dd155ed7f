"""Gradient clipping with ZeRO: ``opt.clip_grad_norm_(max_norm, norm_type)`` against torch DDP +
AdamW + ``torch.nn.utils.clip_grad_norm_`` (docs/torch-zero.md, "Clipping the gradient norm").

Under ZeRO-2 (``DataParallel(shard_gradients=True)``) no rank holds a whole gradient, so the
norm is the global one over every rank's shards, and a plain ``torch.nn.utils.
clip_grad_norm_(model.parameters(), c)``, which would see no gradient and clip nothing, raises
a sentence naming ``opt.clip_grad_norm_`` instead. Every run clips on every step (the norm is
checked to exceed ``max_norm``), compares the returned norm, the parameters after every step
and the AdamW state at the end with DDP's, 2 and 4 gloo ranks in one spawn each.

Exactness: the infinity norm is a maximum, exact under any sharding, so at 2 ranks (where
ZeRO-2 reduces with the all-reduce's arithmetic) the norm, parameters and state are bitwise
DDP's. The 2-norm sums squares over pieces cut at other places than DDP's whole tensors, so the
norm differs from DDP's in the last bits (``NORM_RTOL``: torch's own float32 norm of one tensor
is not correctly rounded, 1e-7 to 1e-5 off the exact value by size) and the parameters by the
resulting coefficient (``same(..., exact=False)``: rtol 1e-5, atol 1e-6). At 4 ranks the
gradients themselves differ from DDP's in the last bits (gloo sums four terms in an order that
depends on the bucket, and DDP's buckets are not DataParallel's), so that floor applies
throughout. ZeRO-1 (whole, averaged gradients on every rank) clips with torch's own function:
bitwise at 2 ranks. ZeRO-2 without ``DataParallel`` reduce-scatters the local gradients in
``clip_grad_norm_`` (``step`` then finds them there): the same results.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from gradsync_torch import DataParallel, ZeroRedundancyOptimizer
from tests.support.harness import run_checks, run_workers
from tests.torch.zero_helpers import batch, make_model, same

STEPS = 4
MAX_NORM = 0.05  # below every step's norm for this model and data: the clip is active
NORM_RTOL = 1e-6
LR = 1e-2


def _reference(model: torch.nn.Module) -> tuple[DDP, torch.optim.Optimizer]:
    ddp = DDP(copy.deepcopy(model))
    return ddp, torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)


def _check_state(
    opt: ZeroRedundancyOptimizer, ref: torch.optim.Optimizer, exact: bool, what: str
) -> None:
    """The consolidated AdamW state equals the reference's, on every rank in turn."""
    expected = ref.state_dict()["state"]
    for to in range(dist.get_world_size()):
        opt.consolidate_state_dict(to=to)
        if dist.get_rank() != to:
            continue
        got = opt.state_dict()["state"]
        assert sorted(got) == sorted(expected), what
        for index, state in expected.items():
            for key, value in state.items():
                same(got[index][key], value, exact, f"{what}: state {index} {key}")


def _run(mode: str, norm_type: float, exact: bool, ws: int, rank: int) -> None:
    """``STEPS`` clipped AdamW steps, ZeRO against DDP + torch's clip. ``mode``: "zero2" (ZeRO-2
    through ``DataParallel(shard_gradients=True)``), "zero2-alone" (ZeRO-2 reduce-scattering
    local gradients itself) or "zero1" (ZeRO-1 after DataParallel's all-reduce)."""
    what = f"{mode} norm_type={norm_type}"
    shard = mode != "zero1"
    model = make_model()
    ddp, ref = _reference(model)
    wrapper = (
        model
        if mode == "zero2-alone"
        else DataParallel(model, shard_gradients=shard, bucket_cap_mb=0.002)
    )
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=LR,
        weight_decay=0.1,
        shard_gradients=shard,
        data_parallel=wrapper if mode == "zero2" else None,
        bucket_cap_mb=0.002,
    )
    if shard:
        assert len(opt.plan().buckets.buckets) > 1, "the pieces must cut parameters"
    for step in range(STEPS):
        x, y = batch(step, ws, rank)
        for m, o in ((wrapper, opt), (ddp, ref)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
        expected = torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM, norm_type)
        got = opt.clip_grad_norm_(MAX_NORM, norm_type)
        assert expected > 2 * MAX_NORM, f"{what}: the clip must be active ({expected})"
        assert got.dtype == expected.dtype and got.shape == expected.shape, (got, expected)
        if exact:
            assert torch.equal(got, expected), f"{what} step {step}: {got} vs {expected}"
        else:
            torch.testing.assert_close(got, expected, rtol=NORM_RTOL, atol=0, msg=what)
        opt.step()
        ref.step()
        for (name, p), q in zip(model.named_parameters(), ddp.module.parameters(), strict=True):
            same(p.detach(), q.detach(), exact, f"{what} step {step} {name}")
    _check_state(opt, ref, exact, what)


def check_zero2_inf_norm(ws: int, rank: int) -> None:
    _run("zero2", math.inf, ws <= 2, ws, rank)


def check_zero2_two_norm(ws: int, rank: int) -> None:
    _run("zero2", 2.0, False, ws, rank)


def check_zero2_alone(ws: int, rank: int) -> None:
    _run("zero2-alone", math.inf, ws <= 2, ws, rank)
    _run("zero2-alone", 2.0, False, ws, rank)


def check_zero1_two_norm(ws: int, rank: int) -> None:
    _run("zero1", 2.0, ws <= 2, ws, rank)


def check_plain_clip_refuses(ws: int, rank: int) -> None:
    """After a ZeRO-2 sync ``param.grad`` holds a placeholder: torch's clip functions (and
    anything else that reads its values) raise a sentence naming the way out, where they
    returned 0.0 and clipped nothing; clearing works, with or without ``set_to_none``."""
    model = make_model()
    wrapper = DataParallel(model, shard_gradients=True, bucket_cap_mb=0.002)
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(),
        torch.optim.AdamW,
        lr=LR,
        shard_gradients=True,
        data_parallel=wrapper,
    )
    x, y = batch(0, ws, rank)
    F.mse_loss(wrapper(x), y).backward()
    sentence = r"sharded over the data-parallel ranks .* opt\.clip_grad_norm_\(max_norm\)"
    for norm_type in (2.0, math.inf):
        with pytest.raises(RuntimeError, match=sentence):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type)
        with pytest.raises(RuntimeError, match=sentence):
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM, norm_type, foreach=True)
    with pytest.raises(RuntimeError, match=sentence):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
    with pytest.raises(RuntimeError, match=sentence):
        model[0].weight.grad.norm()
    grad = model[0].weight.grad  # metadata stays readable
    assert grad.shape == model[0].weight.shape and grad.dtype == model[0].weight.dtype
    assert "0.weight" in repr(grad)
    assert opt.clip_grad_norm_(MAX_NORM) > MAX_NORM  # the way out works after the refusals
    opt.step()
    opt.zero_grad(set_to_none=False)  # torch's zero_grad would call zero_() on the placeholder
    assert all(p.grad is None for p in model.parameters())
    # A second synced backward would accumulate into gradients that only exist as shards,
    # which DDP sums and ZeRO-2 used to overwrite: it now raises, naming no_sync().
    F.mse_loss(wrapper(x), y).backward()
    with pytest.raises(RuntimeError, match=r"opt\.zero_grad\(\).* model\.no_sync\(\)"):
        F.mse_loss(wrapper(x), y).backward()
    opt.zero_grad()
    F.mse_loss(wrapper(x), y).backward()  # cleared: the loop goes on
    opt.step()


def check_bad_norm_type(ws: int, rank: int) -> None:
    model = make_model()
    wrapper = DataParallel(model, shard_gradients=True, bucket_cap_mb=0.002)
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(), torch.optim.AdamW, shard_gradients=True, data_parallel=wrapper
    )
    for bad in (0.0, -1.0, -math.inf, math.nan):
        with pytest.raises(ValueError, match=r"norm_type must be a positive number or inf"):
            opt.clip_grad_norm_(1.0, bad)


def _worker(rank: int, ws: int) -> dict[str, str | None]:
    return run_checks(
        [
            ("zero2 inf norm", lambda: check_zero2_inf_norm(ws, rank)),
            ("zero2 two norm", lambda: check_zero2_two_norm(ws, rank)),
            ("zero2 without DataParallel", lambda: check_zero2_alone(ws, rank)),
            ("zero1 two norm", lambda: check_zero1_two_norm(ws, rank)),
            ("plain clip refuses", lambda: check_plain_clip_refuses(ws, rank)),
            ("bad norm_type", lambda: check_bad_norm_type(ws, rank)),
        ]
    )


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_clip_grad_norm_matches_ddp(world_size: int) -> None:
    results = run_workers(_worker, world_size, timeout=300)
    failures = {
        f"rank {r} {name}": error
        for r, checks in enumerate(results)
        for name, error in checks.items()
        if error is not None
    }
    assert not failures, "\n".join(f"{k}:\n{v}" for k, v in failures.items())
