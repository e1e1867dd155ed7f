"""Every torch.optim optimizer under every sharding is exact or refused: never silently wrong.

The classes are enumerated from ``torch.optim`` (a torch upgrade's new optimizer joins the
sweep by itself) and run at 2 gloo ranks, 3 steps, on a model of bias-free linear layers (so
Muon, which takes matrices only, builds too) under ZeRO-1 and ZeRO-2
(``ZeroRedundancyOptimizer``), ZeRO-3 (``fully_shard`` and the plain class) and each of those
with ``MatrixOptimizer`` around the class. Each case must either raise before its first step
changes anything, or match a replica stepped by the plain class with the same averaged
gradients (rtol 1e-5, atol 1e-6; Muon's bfloat16 Newton-Schulz is bitwise here at 2 ranks).
Which of the two it does must be what the core's optimizer kind says
(``gradsync_core.plan.optimizer_kind``): the one rule, checked against what really runs.
"""

from __future__ import annotations

import inspect
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core.plan import optimizer_kind
from tests.support.harness import run_workers

STEPS = 3
SHARDINGS = ("zero1", "zero2", "zero3", "matrix-zero1", "matrix-zero2", "matrix-zero3")
# What a kind may do under each sharding: "exact" or "refused".
EXPECTED = {
    "elementwise": dict.fromkeys(SHARDINGS, "exact"),
    "per_tensor": {
        "zero1": "exact",
        "zero2": "refused",
        "zero3": "refused",
        "matrix-zero1": "exact",
        "matrix-zero2": "exact",
        "matrix-zero3": "exact",
    },
    "coupled": dict.fromkeys(SHARDINGS, "refused"),
}
# Cases that raise torch's own error in one process too (SparseAdam refuses dense
# gradients): nothing to compare, and nothing silent.
NOT_APPLICABLE = {"SparseAdam"}
# torch's DTensor cannot run Rprop's in-place masked write on a row shard
# (``aten.index_put_``: "in-place operations that require placement changes are not
# supported"): torch refuses, loudly, before the parameter changes.
TORCH_REFUSES = {("Rprop", "zero3")}


def optimizer_classes() -> list[type[torch.optim.Optimizer]]:
    return [
        cls
        for name in sorted(dir(torch.optim))
        if inspect.isclass(cls := getattr(torch.optim, name))
        and issubclass(cls, torch.optim.Optimizer)
        and cls is not torch.optim.Optimizer
    ]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32, bias=False), nn.GELU(), nn.Linear(32, 8, bias=False))


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    n = 8 // world_size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def build(cls: type, sharding: str, net: nn.Module) -> Any:
    from gradsync_torch import MatrixOptimizer, ZeroRedundancyOptimizer, fully_shard

    kw = {"lr": 0.01}
    if sharding.endswith("zero3"):
        fully_shard(net[0])
        fully_shard(net)
    if sharding == "zero1":
        return ZeroRedundancyOptimizer(net.named_parameters(), cls, **kw)
    if sharding == "zero2":
        return ZeroRedundancyOptimizer(net.named_parameters(), cls, shard_gradients=True, **kw)
    if sharding == "zero3":
        return cls(net.named_parameters(), **kw)
    inner = cls(net.named_parameters(), **kw)
    return MatrixOptimizer(inner, shard_gradients=sharding == "matrix-zero2")


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def one_case(cls: type, sharding: str, rank: int, world_size: int) -> str:
    """``"exact"``, ``"refused: ..."`` (nothing changed), or ``"differs by ..."``."""
    net, replica = model(), model()
    before = [p.detach().clone() for p in net.parameters()]
    try:
        opt = build(cls, sharding, net)
    except (ValueError, TypeError) as error:
        return f"refused: {error}"
    reference = cls(replica.parameters(), lr=0.01)
    local_grads = not sharding.endswith(("zero2", "zero3"))  # else the step reduces them
    for step in range(STEPS):
        x, y = batch(step, rank, world_size)

        def loss(net: nn.Module = net, x: torch.Tensor = x, y: torch.Tensor = y) -> Any:
            return nn.functional.mse_loss(net(x), y)

        opt.zero_grad()
        loss().backward()
        grads = []
        for p in net.parameters():  # what one process steps with: the averaged gradients
            g = whole(p.grad).detach().clone() if sharding.endswith("zero3") else p.grad / 2
            if not sharding.endswith("zero3"):
                dist.all_reduce(g)
                if local_grads:
                    p.grad = g.clone()
            grads.append(g)
        try:
            opt.step()  # L-BFGS would need a closure: every sharding refuses it first
        except (ValueError, RuntimeError) as error:
            if step == 0 and all(
                torch.equal(whole(p).detach(), b)
                for p, b in zip(net.parameters(), before, strict=True)
            ):
                return f"refused: {error}"
            return f"raised after changing parameters: {error}"
        for p, g in zip(replica.parameters(), grads, strict=True):
            p.grad = g
        reference.step()
    for p, r in zip(net.parameters(), replica.parameters(), strict=True):
        if not torch.allclose(whole(p).detach(), r.detach(), rtol=1e-5, atol=1e-6):
            return f"differs by {(whole(p).detach() - r.detach()).abs().max().item():.3g}"
    return "exact"


def sweep(rank: int, world_size: int) -> dict[str, str]:
    out = {}
    for cls in optimizer_classes():
        if cls.__name__ in NOT_APPLICABLE:
            continue
        for sharding in SHARDINGS:
            out[f"{cls.__name__}/{sharding}"] = one_case(cls, sharding, rank, world_size)
    return out


@pytest.mark.slow
def test_every_torch_optimizer_is_exact_or_refused_under_every_sharding() -> None:
    results = run_workers(sweep, 2, timeout=600)
    assert results[0].keys() == results[1].keys()
    wrong = []
    for case, outcome in results[0].items():
        name, sharding = case.split("/")
        kind = optimizer_kind(f"torch.optim.{name}")
        expected = "refused" if (name, sharding) in TORCH_REFUSES else EXPECTED[kind][sharding]
        if not outcome.startswith(expected):
            wrong.append(f"{case} ({kind}): expected {expected}, got {outcome[:300]}")
    assert not wrong, "\n".join(wrong)
    refused = {c: o for c, o in results[0].items() if o.startswith("refused")}
    for case, outcome in refused.items():  # the per-tensor ones name the exact path
        name, sharding = case.split("/")
        if optimizer_kind(f"torch.optim.{name}") == "per_tensor":
            assert "gradsync_torch.MatrixOptimizer" in outcome, (case, outcome)
