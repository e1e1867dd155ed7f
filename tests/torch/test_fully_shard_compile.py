"""``torch.compile`` of a model sharded by gradsync's ``fully_shard`` trains exactly as eager
(docs/torch-zero3.md, "torch.compile").

Two ways, at 2 gloo ranks, 2 AdamW steps of the smallest model with an inner unit: compiling
the whole sharded model (dynamo breaks the graph at the sharding hooks, which run eagerly, and
compiles the code between them) and compiling each block before ``fully_shard`` (torchtitan's
way with FSDP2: the hooks sit outside the compiled block). Both must equal eager bitwise. The
backend is ``aot_eager`` (AOTAutograd's forward/backward split, which decides when gradients
reach the hooks) to spare a 2-core machine inductor's C++ compile.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.support.harness import run_checks, run_workers

pytestmark = pytest.mark.slow


def _model(compile_blocks: bool = False) -> nn.Module:
    from gradsync_torch import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Sequential(nn.Linear(6, 6), nn.Tanh()))
    if compile_blocks:
        model[1].compile(backend="aot_eager")
    fully_shard(model[1])
    return fully_shard(model)


def _train(model: nn.Module, rank: int) -> list[torch.Tensor]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for step in range(2):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().to_local() for p in model.parameters()]


def _checks(rank: int, world_size: int) -> dict:
    eager = _train(_model(), rank)

    def same(compiled: list[torch.Tensor]) -> None:
        for a, b in zip(eager, compiled, strict=True):
            assert torch.equal(a, b), (a - b).abs().max()

    def whole() -> None:
        torch._dynamo.reset()
        same(_train(torch.compile(_model(), backend="aot_eager"), rank))

    def blocks() -> None:
        torch._dynamo.reset()
        same(_train(_model(compile_blocks=True), rank))

    return run_checks(
        [("torch.compile(sharded model)", whole), ("blocks compiled, then sharded", blocks)]
    )


def test_compiled_sharded_model_equals_eager():
    for results in run_workers(_checks, 2, timeout=400):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())
