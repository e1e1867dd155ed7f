"""torch's DDP comm hooks, and the compress wrappers around them, on gradsync's DataParallel.

One spawn of 2 gloo ranks runs every case (spawns cost seconds): each of torch's
``DDPCommHookType`` hooks (enumerated, registered through ``register_ddp_comm_hook``), plus
``fp16_compress_wrapper`` / ``bf16_compress_wrapper`` around ``allreduce_hook`` and around
PowerSGD (compressing from step 2), in two layouts (one bucket; several small buckets). Each
case trains the same model on the same data with torch DDP and with ``DataParallel`` for
``STEPS`` SGD steps and requires bitwise-equal gradients at every step; every case is then
reported as its own test. Skipped, with the reason: hooks DDP itself refuses or fails here
(its error is the reason: the bf16 hooks need CUDA and NCCL).

Compressing PowerSGD chains all-reduces from its futures' callbacks, which gloo runs on its
own thread: with several buckets in flight their order differs between ranks and torch DDP
hangs. DataParallel starts each bucket's PowerSGD hook only once the previous bucket's future
is done (``in_bucket_order``), and issues its own used-map all-reduce on the same group only
after every bucket's future is done, so the collectives keep one order on every rank; the
reference DDP runs the hook through the same ``in_bucket_order`` to be comparable. The cases
run on the world group, as DDP's do.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import (
    DDPCommHookType,
    register_ddp_comm_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as default
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powerSGD
from torch.futures import Future
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import gradsync_torch as gt
from gradsync_torch.data_parallel.comm_hooks import in_bucket_order
from tests.support.harness import SKIPPED, Skip, run_checks, run_workers

WORLD_SIZE = 2
STEPS = 4
N = 4  # samples per rank
SMALL_CAP_MB = 0.0005  # ~0.5 KiB buckets: several per model
# PowerSGD's compression starts at this step (the DDPCommHookType entries start at step 1000,
# so within STEPS they only all-reduce); PowerSGD requires a value above 1.
POWER_SGD_START = 2

Register = Callable[[nn.Module], None]


class Case(NamedTuple):
    register: Register
    # The hook issues further collectives from its futures' callbacks (compressing PowerSGD:
    # three all-reduces per bucket, two of them chained), which gloo runs on its own thread.
    chains_collectives: bool = False


def _enum_case(kind: DDPCommHookType) -> Case:
    return Case(
        lambda model, ordered=False: register_ddp_comm_hook(kind, model, state=dist.group.WORLD)
    )


def _power_sgd_case(hook: Callable, wrapper: Callable | None = None) -> Case:
    def register(model: nn.Module, ordered: bool = False) -> None:
        # A fresh state per model: it holds the error feedback and the warm-start factors.
        state = powerSGD.PowerSGDState(
            process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=POWER_SGD_START
        )
        wrapped = hook if wrapper is None else wrapper(hook)
        model.register_comm_hook(state, in_bucket_order(wrapped) if ordered else wrapped)

    return Case(register, chains_collectives=True)


def _wrapped_allreduce_case(wrapper: Callable) -> Case:
    return Case(
        lambda model, ordered=False: model.register_comm_hook(
            dist.group.WORLD, wrapper(default.allreduce_hook)
        )
    )


def cases() -> dict[str, Case]:
    """Every hook type torch enumerates, then the compress wrappers around other hooks, by name."""
    out = {kind.name: _enum_case(kind) for kind in DDPCommHookType}
    out["POWER_SGD_from_step2"] = _power_sgd_case(powerSGD.powerSGD_hook)
    wrappers = {
        "fp16_wrapper": default.fp16_compress_wrapper,
        "bf16_wrapper": default.bf16_compress_wrapper,
    }
    for name, wrapper in wrappers.items():
        out[f"{name}(ALLREDUCE)"] = _wrapped_allreduce_case(wrapper)
        out[f"{name}(POWER_SGD_from_step2)"] = _power_sgd_case(powerSGD.powerSGD_hook, wrapper)
        out[f"{name}(BATCHED_POWER_SGD_from_step2)"] = _power_sgd_case(
            powerSGD.batched_powerSGD_hook, wrapper
        )
    return out


# layout name: keyword arguments of DataParallel and of DDP. With a cap, DDP starts from the
# capped layout only if it looks for unused parameters (otherwise its first step uses one
# bucket), and then keeps it: the reverse parameter order, which is also gradsync's layout
# before and after its rebuild for this model (gradients arrive last layer first).
LAYOUTS: dict[str, tuple[dict, dict]] = {
    "one_bucket": ({}, {}),
    "small_buckets": (
        {"bucket_cap_mb": SMALL_CAP_MB},
        {"bucket_cap_mb": SMALL_CAP_MB, "find_unused_parameters": True},
    ),
}


def mlp() -> nn.Module:
    # Square-ish weights so PowerSGD compresses them (a rank-1 factor is < half the matrix).
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)
    )


def batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    x, y = (
        torch.randn(WORLD_SIZE * N, 6, generator=gen),
        torch.randn(WORLD_SIZE * N, 3, generator=gen),
    )
    return x[rank * N : (rank + 1) * N], y[rank * N : (rank + 1) * N]


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, step: int, rank: int) -> list:
    opt.zero_grad(set_to_none=True)
    x, y = batch(step, rank)
    F.mse_loss(model(x), y).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    opt.step()
    return grads


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else '(no message)'}"


def check_case(case: Case, layout: str, rank: int) -> None:
    """DDP and DataParallel with the same hook: bitwise-equal gradients at every step."""
    ours_kwargs, ddp_kwargs = LAYOUTS[layout]
    # DDP hangs on compressing PowerSGD with several buckets (the hook issues all-reduces from
    # its futures' callbacks on gloo's thread, in a rank-dependent order; seen with torch
    # 2.13, gloo, 2 ranks): DataParallel starts the buckets' hooks one after another
    # (in_bucket_order), and the reference DDP gets the same order to be comparable. Its
    # unused-parameter all-reduce would still race with the chained ones, so it runs without
    # find_unused_parameters: step 0 in one bucket (PowerSGD only all-reduces before
    # POWER_SGD_START, the same sums in any layout), the capped layout from its rebuild on.
    ordered = case.chains_collectives and layout != "one_bucket"
    if ordered:
        ddp_kwargs = {k: v for k, v in ddp_kwargs.items() if k != "find_unused_parameters"}
    base = mlp()
    ddp = DDP(copy.deepcopy(base), **ddp_kwargs)
    try:
        case.register(ddp, ordered=ordered)
    except Exception as error:
        raise Skip(f"torch DDP refuses it here: {_first_line(error)}") from None
    ours = gt.DataParallel(copy.deepcopy(base), **ours_kwargs)
    if layout == "small_buckets":
        assert len(ours.bucket_plan.buckets) > 1, "expected several buckets"
    case.register(ours)
    ddp_opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ours_opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    for step in range(STEPS):
        try:
            expected = _train_step(ddp, ddp_opt, step, rank)
        except Exception as error:
            raise Skip(f"torch DDP fails at step {step}: {_first_line(error)}") from None
        got = _train_step(ours, ours_opt, step, rank)
        for i, (a, b) in enumerate(zip(got, expected, strict=True)):
            assert a.dtype == b.dtype and torch.equal(a, b), (
                f"step {step}, grad {i}: DataParallel differs from DDP by {(a - b).abs().max()}"
            )


def run_sweep(rank: int, world_size: int) -> dict[str, str | None]:
    """Every (layout, case): id -> None (passed), ``"skipped: <reason>"`` (torch DDP itself
    refused, failed or hangs on the hook here: ``Skip``, never a pass) or the failure.

    ``harness.run_checks`` agrees on each case across the ranks, so a case that failed or was
    skipped on one rank only is reported as failed, never as passed; each case builds its own
    models, so the cases after a failure still run (``keep_going``).
    """
    return run_checks(
        (
            (f"{layout}-{name}", functools.partial(check_case, case, layout, rank))
            for layout in LAYOUTS
            for name, case in cases().items()
        ),
        keep_going=True,
    )


CASE_IDS = [f"{layout}-{name}" for layout in LAYOUTS for name in cases()]
_sweep: list[dict[str, str | None]] = []


def _outcomes() -> list[dict[str, str | None]]:
    if not _sweep:
        _sweep.extend(run_workers(run_sweep, WORLD_SIZE, timeout=300))
    return _sweep


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_hook_matches_ddp(case_id: str) -> None:
    outcomes = [by_rank[case_id] for by_rank in _outcomes()]
    for rank, outcome in enumerate(outcomes):
        assert outcome is None or outcome.startswith(SKIPPED), f"rank {rank}: {outcome}"
    if outcomes[0] is not None:
        pytest.skip(outcomes[0].removeprefix(SKIPPED))


# ---- GradBucket alone: DDP's set_buffer / gradients() contract, no process group ----------


def _bucket() -> tuple[gt.GradBucket, torch.Tensor]:
    staging = torch.arange(12.0)
    buffer = staging[2:12]  # a bucket need not start its storage (legacy mode shares one)
    views = [buffer[0:6].view(2, 3), buffer[6:10].view(4)]
    params = [nn.Parameter(torch.zeros(2, 3)), nn.Parameter(torch.zeros(4))]
    return gt.GradBucket(0, buffer, views, params, True), buffer


def test_gradients_follow_set_buffer() -> None:
    bucket, buffer = _bucket()
    bucket.set_buffer(buffer.to(torch.float16))
    first, second = bucket.gradients()
    assert (first.dtype, first.shape, second.shape) == (torch.float16, (2, 3), (4,))
    assert torch.equal(first, buffer[:6].view(2, 3).half())
    assert torch.equal(second, buffer[6:].half())
    second.zero_()  # views: writes land in the new buffer, as an in-place hook expects
    assert bucket.buffer()[6:].abs().sum() == 0 and buffer[6:].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_compress_wrapper_hands_inner_hook_cast_gradients(dtype: torch.dtype) -> None:
    """Issue 16 without a process group: the inner hook sees the cast bucket everywhere."""
    wrapper = {
        torch.float16: default.fp16_compress_wrapper,
        torch.bfloat16: default.bf16_compress_wrapper,
    }
    seen: list[torch.dtype] = []

    def halve(state: object, bucket: gt.GradBucket) -> Future[torch.Tensor]:
        seen.extend(g.dtype for g in bucket.gradients())
        for g in bucket.gradients():  # in place through the views, as PowerSGD does
            g.mul_(0.5)
        done: Future[torch.Tensor] = Future()
        done.set_result(bucket.buffer())
        return done

    bucket, buffer = _bucket()
    before = buffer.clone()
    result = wrapper[dtype](halve)(None, bucket).wait()
    assert seen == [dtype, dtype]
    assert torch.equal(result.float(), (before * 0.5).to(dtype).float())


def test_gradients_reject_a_short_buffer() -> None:
    bucket, _ = _bucket()
    bucket.set_buffer(torch.zeros(3))
    with pytest.raises(ValueError, match="at least 10 elements"):
        bucket.gradients()
