"""``torch.compile`` with DataParallel, both ways round, at 2 gloo ranks
(docs/torch-data-parallel.md).

``torch.compile(DataParallel(model))`` and ``DataParallel(torch.compile(model))`` must give
the gradients of eager DataParallel on the same model and data, over a few SGD steps, and keep
the bucket machinery working (its hooks fire: the layout is rebuilt from the observed order).
The compiled programs may fuse and reorder float arithmetic, so the comparison uses
``REF_TOL``; the backend is ``aot_eager`` (AOTAutograd's forward/backward split, which is what
decides when gradients reach the hooks, without inductor's C++ compile time on a 2-core CI
machine). One spawn runs both cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import gradsync_torch as gt
from tests.support.harness import run_workers

pytestmark = pytest.mark.slow

REF_TOL = {"rtol": 1e-5, "atol": 1e-6}
STEPS = 3
N = 4  # samples per rank


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3)
    )


def train(model: nn.Module, rank: int) -> list[list[torch.Tensor]]:
    """Gradients of every step of a short SGD run on rank ``rank``'s data."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    history = []
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x, y = torch.randn(N, 6, generator=gen), torch.randn(N, 3, generator=gen)
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        history.append([p.grad.clone() for p in model.parameters()])
        opt.step()
    return history


def compiled_runs(rank: int, world_size: int) -> dict[str, str | None]:
    """Per way of compiling: None when it matched eager DataParallel, else the difference."""
    torch._dynamo.reset()
    base = mlp()
    eager = train(gt.DataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005), rank)
    outer = gt.DataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005)
    inner = gt.DataParallel(
        torch.compile(copy.deepcopy(base), backend="aot_eager"), bucket_cap_mb=0.0005
    )
    runs = {
        "compile(DataParallel(model))": (outer, torch.compile(outer, backend="aot_eager")),
        "DataParallel(compile(model))": (inner, inner),
    }
    outcome: dict[str, str | None] = {}
    for name, (wrapper, model) in runs.items():
        got = train(model, rank)
        outcome[name] = None
        for step, (a, b) in enumerate(zip(got, eager, strict=True)):
            for i, (g, e) in enumerate(zip(a, b, strict=True)):
                if not torch.allclose(g, e, **REF_TOL):
                    outcome[name] = f"step {step} grad {i}: off by {(g - e).abs().max():.3g}"
        if wrapper.bucket_plan.order != "observed":
            outcome[name] = f"the hooks never fired: layout {wrapper.bucket_plan.order!r}"
    return outcome


def test_compiled_data_parallel_matches_eager() -> None:
    outcomes = run_workers(compiled_runs, 2, timeout=300)
    for rank, outcome in enumerate(outcomes):
        assert set(outcome) == {"compile(DataParallel(model))", "DataParallel(compile(model))"}
        for name, error in outcome.items():
            assert error is None, f"rank {rank}, {name}: {error}"
