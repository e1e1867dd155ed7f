"""``LlamaShape.activation_bytes`` counts what torch's autograd saves for the Llama reference.

The composed estimate of ``gradsync plan --batch --seq`` adds activations from a formula in
the model's sizes (docs/nd-parallel.md, "Activations"). Here a saved-tensors hook records
every tensor autograd keeps for the backward of one forward and loss of
``examples/llama_torch.py``'s model (each storage once; the parameters, ``fully_shard``'s
gathered ones too, left out: they are model states): on one process in three dtypes, and on
4 gloo ranks laid out by ``parallelize`` under tensor parallelism with and without sequence
parallelism and with context parallelism. The formula must give the same bytes, exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import pytest
import torch

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, lm_loss_share, parallelize
from gradsync_core import Topology
from gradsync_core.plan._llama import LlamaShape
from tests.support.harness import run_workers

CONFIG = LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96)
SHAPE = LlamaShape(**{f: getattr(CONFIG, f) for f in LlamaShape.__dataclass_fields__})


def _saved_bytes(run: Callable[[], Any]) -> int:
    """The bytes of the storages autograd saves while ``run()`` runs, each once, leaving out
    the parameters and views of them (model states: ``fully_shard``'s gathered weights too,
    whose storage it frees after the forward, so the parameters are never keyed)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if not (base.is_leaf and base.requires_grad):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return sum(seen.values())


def _batch(rows: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return (
        torch.randint(0, CONFIG.vocab_size, (rows, seq), generator=g),
        torch.randint(0, CONFIG.vocab_size, (rows, seq), generator=g),
    )


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
@pytest.mark.parametrize(("rows", "seq"), [(1, 8), (3, 16)])
def test_one_process_saves_what_the_formula_counts(dtype: str, rows: int, seq: int) -> None:
    model = Llama(CONFIG).to(getattr(torch, dtype))
    tokens, targets = _batch(rows, seq)
    saved = _saved_bytes(lambda: lm_loss_share(model(tokens), targets, rows * seq))
    want = SHAPE.activation_bytes(
        Topology.create(1), rows=rows, seq_len=seq, layers=CONFIG.n_layers, dtype=dtype
    )
    assert saved == want


# (axis sizes on 4 ranks, sequence parallelism)
LAYOUTS = {
    "tp 2 x dp 2, sp": ({"tp": 2}, True),
    "tp 2 x dp 2, no sp": ({"tp": 2}, False),
    "tp 2 x cp 2, sp": ({"tp": 2, "cp": 2}, True),
}
ROWS, SEQ = 4, 16


def _loss(par: Any, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    loss: torch.Tensor = par.loss_fn(par.parts[0](tokens), targets)
    return loss


def _rank_saved(rank: int, ws: int) -> dict[str, int]:
    """Per layout: the bytes this rank's autograd saves for its forward and loss."""
    out = {}
    for name, (sizes, sp) in LAYOUTS.items():
        topology = Topology.create(ws, **sizes)
        par = parallelize(
            Llama(CONFIG), topology, ParallelOptions(sequence_parallel=sp), seq_len=SEQ
        )
        tokens, targets = par.local_batch(*_batch(ROWS, SEQ))
        out[name] = _saved_bytes(partial(_loss, par, tokens, targets))
    return out


@pytest.mark.slow
def test_tensor_and_context_parallel_ranks_save_what_the_formula_counts() -> None:
    results = run_workers(_rank_saved, 4, timeout=300)
    for name, (sizes, sp) in LAYOUTS.items():
        topology = Topology.create(4, **sizes)
        want = SHAPE.activation_bytes(
            topology,
            rows=ROWS // topology.dp,
            seq_len=SEQ,
            layers=CONFIG.n_layers,
            sequence_parallel=sp,
        )
        assert [r[name] for r in results] == [want] * 4, name
