"""Checks run inside 2 spawned gloo ranks by ``test_rank_agreement.py``: ranks that build or
run ``DataParallel`` differently get one clear error on every rank (docs/torch-data-parallel.md).

Every fault here used to hang or, worse, silently average gradients of different steps.
After each expected error the ranks have issued the same collectives, so one process group
serves every check in turn. No tests of its own.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

import gradsync_torch as gt
from gradsync_torch.data_parallel import DataParallelOptions
from tests.torch.dp_grad_checks import batch, expect_error, mlp, shard

# For every DataParallel option that shapes the collectives: a valid value other than the
# default, built on the last rank only. A new option must be added here or to CHECKED_ELSEWHERE,
# or test_every_option_is_covered fails.
DIFFERING_VALUES: dict[str, object] = {
    "bucket_cap_mb": 1.0,
    "overlap": False,
    "reduce": "sum",
    "reduce_dtype": torch.bfloat16,
    "gradient_as_bucket_view": True,
    "broadcast_buffers": False,
    "param_broadcast_period": 3,
    "shard_gradients": True,
    "check_finite": True,
}
# Options agreed by another check, and why they are not in the option comparison.
CHECKED_ELSEWHERE = {
    "module": "compared parameter by parameter (tests/torch/dp_setup_checks.py mismatches)",
    "process_group": "the group the comparison runs on: a rank outside it is refused",
    "groups": "model-parallel plans are compared over the world by check_reduction_plan",
    "shared_plan": "compared over the world by check_reduction_plan, as with groups",
    "options": "the record of the agreed options above, compared field by field however given",
}


def constructor_options() -> list[str]:
    """Every parameter of ``DataParallel.__init__`` except ``self``."""
    return [n for n in inspect.signature(gt.DataParallel.__init__).parameters if n != "self"]


def check_every_option_agrees(rank: int, ws: int) -> None:
    """One rank builds with one option changed: a ValueError naming it, on every rank."""
    odd = ws - 1
    for name in (field.name for field in dataclasses.fields(DataParallelOptions)):
        kwargs = {name: DIFFERING_VALUES[name]} if rank == odd else {}
        expect_error(
            ValueError,
            [f"ranks {list(range(odd))} and ranks [{odd}]", f"option {name} "],
            lambda kwargs=kwargs: gt.DataParallel(mlp(), **kwargs),
        )
    gt.DataParallel(mlp())  # the group is still in step


class Gate(nn.Module):
    """An MLP, or (``use=False``) an output computed from the input alone: a forward that
    uses no trainable parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.body = mlp()

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:
        return self.body(x) if use else 2.0 * x[:, :3]


def _loss(model: nn.Module, s: int, rank: int, ws: int, use: bool = True) -> torch.Tensor:
    x, y = batch(s, ws)
    return F.mse_loss(model(shard(x, rank), use), shard(y, rank))


def _disagreement(run: Callable[[], None], needles: list[str]) -> None:
    text = expect_error(RuntimeError, ["reached this gradient sync differently", *needles], run)
    assert "ranks [0]: sync" in text and "ranks [1]: sync" in text, text


def check_runtime_faults(rank: int, ws: int) -> None:
    """Each fault raises at the sync where the ranks first differ, on every rank, naming
    both ranks and what each did."""
    assert ws == 2, "these scenarios pair rank 0 with rank 1"

    # An extra backward (retain_graph) on rank 1: its second sync meets rank 0's next step.
    model = gt.DataParallel(Gate())
    model.zero_grad(set_to_none=True)
    loss = _loss(model, 0, rank, ws)
    loss.backward(retain_graph=True)

    def next_sync() -> None:
        if rank == 1:
            loss.backward()  # no forward, accumulated onto the synced gradients
        else:
            model.zero_grad(set_to_none=True)
            _loss(model, 1, rank, ws).backward()

    _disagreement(next_sync, ["sync #1", "0 forward(s)", "kept from the previous"])

    # An extra forward and backward (a second micro-step without zero_grad) on rank 1.
    model = gt.DataParallel(Gate())
    model.zero_grad(set_to_none=True)
    _loss(model, 0, rank, ws).backward()

    def extra_step() -> None:
        if rank == 0:
            model.zero_grad(set_to_none=True)
        _loss(model, 1, rank, ws).backward()

    _disagreement(extra_step, ["sync #1", "kept from the previous"])

    # no_sync() on rank 0 only, in both modes (legacy syncs in sync_gradients()).
    for overlap in (True, False):
        model = gt.DataParallel(Gate(), overlap=overlap)

        def one_sided_no_sync(model: gt.DataParallel = model) -> None:
            if rank == 0:
                with model.no_sync():
                    _loss(model, 0, rank, ws).backward()
            _loss(model, 1, rank, ws).backward()
            model.sync_gradients()

        needles = ["sync #0", "2 forward(s)", "1 forward(s)"]
        _disagreement(one_sided_no_sync, needles + (["2 backward(s)"] if overlap else []))

    # Accumulation over 3 micro-steps on rank 0, 2 on rank 1.
    model = gt.DataParallel(Gate())

    def uneven_accumulation() -> None:
        with model.no_sync():
            for s in range(2 - rank):
                _loss(model, s, rank, ws).backward()
        _loss(model, 2, rank, ws).backward()

    _disagreement(uneven_accumulation, ["3 forward(s) and 3 backward(s)"])

    # Two wrappers of the same size synced crosswise: only their layouts tell them apart.
    torch.manual_seed(0)
    first, second = (
        gt.DataParallel(nn.Sequential(nn.Linear(6, 3))),
        gt.DataParallel(nn.Linear(6, 3)),
    )

    def crossed() -> None:
        model = first if rank == 0 else second
        F.mse_loss(model(torch.ones(2, 6)), torch.zeros(2, 3)).backward()

    _disagreement(crossed, ["layout"])

    # The group is in step after every error: a normal step completes on both ranks.
    model = gt.DataParallel(Gate())
    _loss(model, 0, rank, ws).backward()


def check_idle_rank_takes_part(rank: int, ws: int) -> None:
    """A rank whose forward uses no trainable parameter runs its backward and syncs zeros:
    every rank ends with the mean of the others' gradients (reference: the active rank's
    gradient divided by the group size, bitwise) and the same parameters after SGD steps."""
    for options in ({}, {"overlap": False}, {"gradient_as_bucket_view": True}):
        for idle in (0, 1):
            torch.manual_seed(0)
            base = Gate()
            model = gt.DataParallel(copy.deepcopy(base), **options)
            reference = copy.deepcopy(base)
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
            for s in range(3):
                # The idle rank alternates, so both first-sync layouts (rebuild from an idle
                # rank 0's empty ready order) and later steps are covered.
                idle_now = idle if s % 2 == 0 else 1 - idle
                model.zero_grad(set_to_none=True)
                _loss(model, s, rank, ws, use=rank != idle_now).backward()
                if not model.options.overlap:
                    model.sync_gradients()
                ref_opt.zero_grad(set_to_none=True)
                _loss(reference, s, 1 - idle_now, ws).backward()
                what = f"{options}, idle rank {idle_now}, step {s}"
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    assert p.grad is not None, f"{what}: no gradient"
                    q.grad.div_(ws)
                    assert torch.equal(p.grad, q.grad), f"{what}: gradient"
                opt.step()
                ref_opt.step()
                for p, q in zip(model.parameters(), reference.parameters(), strict=True):
                    assert torch.equal(p, q), f"{what}: parameters"


CHECKS: dict[str, Callable[[int, int], None]] = {
    "every_option_agrees": check_every_option_agrees,
    "runtime_faults": check_runtime_faults,
    "idle_rank_takes_part": check_idle_rank_takes_part,
}
