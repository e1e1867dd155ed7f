"""Shared pieces of the ZeRO tests: a small model, per-step batches, and ``Pair``, which
steps a ZeroRedundancyOptimizer and a plain torch optimizer side by side and compares them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from gradsync_torch import ZeroRedundancyOptimizer

BATCH = 24  # divisible by 1, 2, 3 and 4 ranks


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(16, 32),
        nn.LayerNorm(32),
        nn.GELU(),
        nn.Linear(32, 24),
        nn.GELU(),
        nn.Linear(24, 8),
    )


def batch(step: int, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's slice of a global batch that depends only on the step."""
    gen = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(BATCH, 16, generator=gen), torch.randn(BATCH, 8, generator=gen)
    n = BATCH // world_size
    return x[rank * n : (rank + 1) * n], y[rank * n : (rank + 1) * n]


def averaged(grad: torch.Tensor, world_size: int) -> torch.Tensor:
    """DataParallel's mean: divide by world_size, then sum (docs/design.md §7)."""
    out = grad / world_size
    if world_size > 1:
        dist.all_reduce(out)
    return out


def same(a: torch.Tensor, b: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(a, b), f"{what}: max diff {(a - b).abs().max().item():.3g}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


class Pair:
    """A ZeRO-trained model and a plain-optimizer reference fed the same averaged grads."""

    def __init__(
        self,
        world_size: int,
        make_opt: Callable[[nn.Module], ZeroRedundancyOptimizer],
        make_ref: Callable[[nn.Module], torch.optim.Optimizer],
        *,
        model: nn.Module | None = None,
        step_index: int = 0,
    ) -> None:
        self.world_size, self.rank = world_size, dist.get_rank()
        self.model = make_model() if model is None else model
        self.ref_model = copy.deepcopy(self.model)
        self.opt, self.ref = make_opt(self.model), make_ref(self.ref_model)
        self.exact = world_size <= 2 or not self.opt.shard_gradients
        self.step_index = step_index

    def backward(self) -> None:
        """Local backward; reference gets the averaged grads, ZeRO-1 too (ZeRO-2 keeps
        its local grads and reduce-scatters them itself)."""
        x, y = batch(self.step_index, self.world_size, self.rank)
        F.mse_loss(self.model(x), y).backward()
        pairs = [
            (p, q)
            for p, q in zip(self.model.parameters(), self.ref_model.parameters(), strict=True)
            if p.grad is not None
        ]
        flat = averaged(torch.cat([p.grad.reshape(-1) for p, _ in pairs]), self.world_size)
        for (p, q), g in zip(pairs, flat.split([p.numel() for p, _ in pairs]), strict=True):
            q.grad = g.view_as(p).clone()
            if not self.opt.shard_gradients:
                p.grad.copy_(q.grad)

    def step(self, closure: bool = False) -> None:
        self.opt.zero_grad()
        self.ref.zero_grad()
        if closure:

            def run() -> float:
                self.backward()
                return 1.0

            assert self.opt.step(run) == 1.0
        else:
            self.backward()
            self.opt.step()
        self.ref.step()
        self.step_index += 1
        self.check_params()

    def check_params(self) -> None:
        for (name, p), q in zip(
            self.model.named_parameters(), self.ref_model.parameters(), strict=True
        ):
            same(p.detach(), q.detach(), self.exact, f"step {self.step_index} {name}")

    def check_state(self) -> None:
        """Consolidated state (on every rank in turn) equals the reference optimizer's."""
        expected = self.ref.state_dict()
        for to in range(self.world_size):
            self.opt.consolidate_state_dict(to=to)
            if self.rank != to:
                with pytest.raises(RuntimeError, match="consolidate_state_dict"):
                    self.opt.state_dict()
                continue
            got = self.opt.state_dict()
            assert sorted(got["state"]) == sorted(expected["state"])
            for index, state in expected["state"].items():
                assert sorted(got["state"][index]) == sorted(state), index
                for key, value in state.items():
                    same(got["state"][index][key], value, self.exact, f"state {index} {key}")
            for mine, theirs in zip(got["param_groups"], expected["param_groups"], strict=True):
                assert mine["params"] == theirs["params"]
                assert mine["lr"] == theirs["lr"]


def zero(cls: type, **kw: Any) -> Callable[[nn.Module], ZeroRedundancyOptimizer]:
    options = {
        k: kw.pop(k)
        for k in ("shard_gradients", "parameters_as_bucket_view", "bucket_cap_mb")
        if k in kw
    }
    return lambda m: ZeroRedundancyOptimizer(m.named_parameters(), cls, **options, **kw)


def plain(cls: type, **kw: Any) -> Callable[[nn.Module], torch.optim.Optimizer]:
    kw = {
        k: v
        for k, v in kw.items()
        if k not in ("shard_gradients", "parameters_as_bucket_view", "bucket_cap_mb")
    }
    return lambda m: cls(m.parameters(), **kw)
