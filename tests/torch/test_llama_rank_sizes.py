"""``gradsync plan``'s per-rank Llama parameters are what ``parallelize`` leaves on each rank.

8 gloo ranks lay ``examples/llama_torch.py``'s model out (no training step); each rank reports
its parameters' shapes before ``fully_shard`` (the DTensor's global shape: the tp slice of its
stage) and the elements ``fully_shard`` keeps locally. ``LlamaShape.rank_specs`` must list the
same names and shapes, and ``llama_memory``'s parameter bytes the same bytes, on every rank.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, parallelize
from gradsync_core import Topology
from gradsync_core.plan._llama import LLAMA_MODELS, llama_memory
from tests.support.harness import run_workers

# (built-in model, axis sizes of Topology.create on 8 ranks)
CASES = {
    "dp_shard 2 x tp 2 x pp 2": ("llama-nd", {"tp": 2, "pp": 2}),
    "ep 2 x dp_shard 4 x pp 2, MoE": ("llama-nd-moe", {"ep": 2, "pp": 2}),
    "dp_replicate 2 x dp_shard 2 x tp 2": ("llama-nd", {"tp": 2, "dp_shard": 2}),
}


def _held(rank: int, ws: int) -> dict[str, tuple[int, dict[str, tuple[int, ...]], int]]:
    """Per case: this rank's pp rank, its parameters' shapes, its local bytes."""
    out = {}
    for case, (model, sizes) in CASES.items():
        shape = LLAMA_MODELS[model]
        config = LlamaConfig(
            **{
                k: getattr(shape, k)
                for k in (
                    "vocab_size",
                    "dim",
                    "n_layers",
                    "n_heads",
                    "n_kv_heads",
                    "ffn_dim",
                    "n_experts",
                )
            }
        )
        topology = Topology.create(ws, **sizes)
        model_ = parallelize(Llama(config), topology, ParallelOptions(microbatches=2), seq_len=8)
        shapes, local = {}, 0
        for part in model_.parts:
            for name, param in part.named_parameters():
                shapes[name] = tuple(param.shape)
                held = param.to_local() if isinstance(param, DTensor) else param
                local += held.numel() * held.element_size()
        out[case] = (model_.groups.group_rank("pp"), shapes, local)
        dist.barrier()
    return out


@pytest.fixture(scope="module")
def held() -> list[dict[str, tuple[int, dict[str, tuple[int, ...]], int]]]:
    return run_workers(_held, 8, timeout=300)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_plan_lists_what_parallelize_leaves_on_each_rank(case, held):
    model, sizes = CASES[case]
    shape, topology = LLAMA_MODELS[model], Topology.create(8, **sizes)
    predicted = llama_memory(shape, topology)
    for rank, outcome in enumerate(held):
        pp_rank, shapes, local = outcome[case]
        want = {s.name: s.shape for s in shape.rank_specs(topology, pp_rank)}
        assert shapes == want, f"rank {rank} (pp rank {pp_rank})"
        # Every size here divides its shard group, so no rank is short: all hold the plan's.
        assert local == predicted[pp_rank].memory.parameter_bytes, f"rank {rank}"
