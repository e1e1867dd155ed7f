"""Ranks that run a sharded model differently get one sentence on every rank, never a hang
(docs/torch-zero3.md, "Never a hang").

Each case makes one rank diverge (units in another order, a unit skipped, a module called
twice, a parameter unused) and checks that every rank raises the same ``ValueError`` naming
the unit and the ranks on each side. The process group's timeout is short, so a regression
that hangs fails in seconds. A module called twice on *every* rank is legal (as in FSDP2):
that case trains and equals FSDP2. (A plan that differs across ranks is caught at
construction: test_fully_shard.py's "plan differs across ranks".) A rank that leaves the loop
cannot be caught by the agreement, which needs every rank at a collective: the others' wait
ends at the process group's timeout, and the error names the collective, its unit and the
ranks that never came.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.support.harness import run_checks, run_workers


class Block(nn.Module):
    """A layer plus a second one that a step may leave out (``extra``)."""

    def __init__(self) -> None:
        super().__init__()
        self.main, self.extra = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, extra: bool) -> torch.Tensor:
        return self.main(x) + (self.extra(x) if extra else 0)


class Blocks(nn.Module):
    """Three blocks run in the order ``route`` names."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), Block()

    def forward(self, x: torch.Tensor, route: tuple[str, ...], extra: bool) -> torch.Tensor:
        for name in route:
            x = getattr(self, name)(x, extra or name != "c")
        return x


def _sharded(shard=None) -> Blocks:
    from gradsync_torch import fully_shard

    shard = shard or fully_shard
    torch.manual_seed(0)
    model = Blocks()
    for block in (model.a, model.b, model.c):
        shard(block)
    shard(model)
    return model


def _step(model: Blocks, rank: int, route: tuple[str, ...], extra: bool = True) -> None:
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    model(x, route, extra).square().mean().backward()


def _diverges(rank: int, *, route: tuple[str, ...], extra: bool = True, expect: list[str]):
    """Rank 1 takes ``route``/``extra``, rank 0 the normal step; both raise one sentence."""

    def check() -> None:
        model = _sharded()
        _step(model, rank, ("a", "b", "c"))  # a normal step first: prefetch is on
        with pytest.raises(ValueError) as error:
            if rank == 1:
                _step(model, rank, route, extra)
            else:
                _step(model, rank, ("a", "b", "c"))
        message = str(error.value)
        for part in expect:
            assert part in message, (part, message)
        sentences: list = [None] * dist.get_world_size()
        dist.all_gather_object(sentences, message)
        assert all(s == message for s in sentences), sentences  # the same sentence everywhere

    return check


def _twice_everywhere(rank: int) -> None:
    """Block a called twice on every rank: legal, and bitwise FSDP2's result."""
    from torch.distributed.fsdp import fully_shard as fsdp2

    results = []
    for shard in (fsdp2, None):
        model = _sharded(shard)
        opt = torch.optim.AdamW(model.parameters(), lr=0.01)
        for _ in range(2):
            _step(model, rank, ("a", "a", "b", "c"))
            opt.step()
            opt.zero_grad()
        results.append([p.to_local() for p in model.parameters()])
    for theirs, ours in zip(*results, strict=True):
        assert torch.equal(theirs, ours), (theirs - ours).abs().max()


def _checks(rank: int, world_size: int) -> dict:
    # Which collective meets which depends on prefetching; the sentence names both sides.
    at = "ranks [0] are at {} #{} of unit {!r} (4 parameters), ranks [1] at {} #{} of unit {!r}"
    checks = [
        (
            "units in another order on one rank",
            _diverges(
                rank,
                route=("b", "a", "c"),
                expect=[at.format("all-gather", 5, "b", "all-gather", 5, "a")],
            ),
        ),
        (
            "a unit skipped on one rank",
            _diverges(
                rank,
                route=("a", "c"),
                expect=[at.format("all-gather", 5, "b", "all-gather", 5, "a")],
            ),
        ),
        (
            "a module called twice on one rank",
            _diverges(
                rank,
                route=("a", "a", "b", "c"),
                expect=[at.format("all-gather", 3, "c", "all-gather", 3, "a")],
            ),
        ),
        (
            "a parameter unused on one rank",
            _diverges(
                rank,
                route=("a", "b", "c"),
                extra=False,
                expect=[
                    "both are at reduce-scatter #6 of unit 'c', but parameters "
                    "['extra.bias', 'extra.weight'] have a gradient on ranks [0] and not on "
                    "ranks [1]"
                ],
            ),
        ),
        ("a module called twice on every rank equals FSDP2", lambda: _twice_everywhere(rank)),
    ]
    return run_checks(checks)


def test_divergent_ranks_raise_one_sentence():
    for results in run_workers(_checks, 2, timeout=240, pg_timeout_s=30):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())


STALL_TIMEOUT_S = 4  # the process group's timeout in the stall test
STALL_GRACE_S = 2  # how long the ranks that gave up wait for the others' reports


def _stalls(rank: int, world_size: int) -> str | None:
    """The last rank leaves the loop after one step; the others' next step stalls in its first
    collective and raises one sentence naming it, its unit and the rank that never came."""
    from gradsync_torch.param_sharding import _stall

    _stall.GRACE_S = STALL_GRACE_S  # 10 s by default; the ranks here give up together
    model = _sharded()
    _step(model, rank, ("a", "b", "c"))
    if rank == world_size - 1:
        time.sleep(STALL_TIMEOUT_S + STALL_GRACE_S + 3)  # gone until the others reported
        return None
    with pytest.raises(RuntimeError) as error:
        _step(model, rank, ("a", "b", "c"))
    return str(error.value)


@pytest.mark.slow
def test_a_rank_that_leaves_is_named():
    world_size = 3
    messages = run_workers(_stalls, world_size, timeout=120, pg_timeout_s=STALL_TIMEOUT_S)[
        : world_size - 1
    ]
    for message in messages:
        assert message.startswith(
            "fully_shard: all-gather #1 of unit 'a' (4 parameters) did not complete"
        ), message
        assert "ranks [2] of its group [0, 1, 2] never reached it" in message, message
        assert "ranks [0, 1] waited in it" in message, message
