"""Checks of ``examples/llama_torch.parallelize`` that run inside 8 spawned gloo ranks.

``test_nd_parallel.py`` spawns the ranks once and runs every check here in them. Each
composition trains the tiny Llama ``STEPS`` steps (AdamW, gradients clipped by the whole
model's norm) and compares every rank's parameters AND AdamW moments with the same model
trained in one process on the whole batch, sliced to the rank's pieces. Both train in
float64, as tests/torch/test_model_parallel.py compares tensor parallelism (rtol 1e-10):
the data-parallel mean, the tensor/context-parallel sums and the microbatch accumulation add
in another order than the single process, and Adam divides by the root of the second moment,
which turns the last bits of a near-zero gradient into visible differences in float32 (up
to 1.4e-5 on weights of size 0.2 after 4 steps, a handful of elements: measured). In
float64 that floor is far below ``RTOL`` (relative to each tensor's largest entry), and any
real mistake (a missing sum, a wrong scale) is far above it. The largest differences are
written to ``directory/<name>.json`` for the test to report.

This module holds no tests of its own.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, lm_loss_share, local_state, parallelize
from gradsync_core import Topology

STEPS = 4
SEQ = 16
BATCH = 8
LR = 1e-2
MAX_NORM = 0.5  # below the first steps' norms, so the clip scales
RTOL = 1e-10  # of each tensor's largest entry, float64 (see the module docstring)
DENSE = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)
MOE = LlamaConfig(
    vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=32, n_experts=4
)

# name: (config, topology arguments for 8 ranks, options)
COMPOSITIONS: dict[str, tuple[LlamaConfig, dict[str, Any], ParallelOptions]] = {
    "dp_shard2_tp2_pp2": (DENSE, {"tp": 2, "pp": 2}, ParallelOptions(microbatches=2)),
    "dp_replicate2_dp_shard2_tp2": (DENSE, {"tp": 2, "dp_shard": 2}, ParallelOptions()),
    "tp2_cp2_dp2_sp": (DENSE, {"tp": 2, "cp": 2}, ParallelOptions(sequence_parallel=True)),
    "ep2_dp_shard2_pp2_moe": (
        MOE,
        {"ep": 2, "pp": 2, "dp_shard": 2},
        ParallelOptions(microbatches=2),
    ),
}


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``STEPS`` global batches of random tokens and their next-token targets."""
    gen = torch.Generator().manual_seed(7)
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, DENSE.vocab_size, (BATCH, SEQ + 1), generator=gen)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def train_single(config: LlamaConfig) -> tuple[Llama, torch.optim.Optimizer]:
    """The reference: one process, the whole batch, the mean loss, torch's clip."""
    model = Llama(config).double()
    opt = _adamw(model.parameters())
    for tokens, targets in batches():
        lm_loss_share(model(tokens), targets, tokens.numel()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model, opt


def full_piece(t: torch.Tensor) -> torch.Tensor:
    """A tensor-parallel piece whole over the data-parallel shards."""
    return t.full_tensor() if isinstance(t, DTensor) else t


Pair = tuple[str, str, torch.Tensor, torch.Tensor]


def against_reference(
    model: Any,
    opt: torch.optim.Optimizer,
    reference: torch.nn.Module,
    ref_opt: torch.optim.Optimizer,
) -> tuple[list[Pair], dict[str, float]]:
    """Each of this rank's parameters and Adam moments, whole over the data-parallel shards,
    beside the single-process run's piece of it: ``(kind, name, actual, expected)``, and the
    largest difference of each kind. A collective: every gather (``full_tensor``) happens
    here, so the caller asserts after it and a rank that fails leaves no peer waiting."""
    ref_params = dict(reference.named_parameters(remove_duplicate=False))
    moments = {
        key: {n: ref_opt.state[p][key] for n, p in ref_params.items()}
        for key in ("exp_avg", "exp_avg_sq")
    }
    pairs: list[Pair] = []
    for part in model.parts:
        want = {"params": local_state(part, {n: p.detach() for n, p in ref_params.items()})}
        want |= {key: local_state(part, moments[key]) for key in moments}
        for pname, param in part.named_parameters():
            state = opt.state[param]
            got = {"params": param.detach(), **{k: state[k] for k in moments}}
            for kind, value in got.items():
                pairs.append((kind, pname, full_piece(value), want[kind][pname]))
    worst = {"params": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for kind, _, actual, expected in pairs:
        if actual.shape == expected.shape:
            worst[kind] = max(worst[kind], float((actual - expected).abs().max()))
    return pairs, worst


def assert_close_pairs(pairs: list[Pair], name: str) -> None:
    """Every pair within ``RTOL`` of its reference (relative to the reference's largest)."""
    for kind, pname, actual, expected in pairs:
        scale = float(expected.abs().max())
        error = (actual - expected).abs().max()
        assert torch.allclose(actual, expected, rtol=RTOL, atol=RTOL * scale), (
            f"{name}: {kind} of {pname}: largest difference {float(error):.3e} "
            f"(atol {RTOL * scale:.3e})"
        )


def check_composition(rank: int, ws: int, name: str, directory: str) -> None:
    config, sizes, options = COMPOSITIONS[name]
    topology = Topology.create(ws, **sizes)
    reference, ref_opt = train_single(config)
    model = parallelize(Llama(config).double(), topology, options, seq_len=SEQ)
    opt = _adamw(list(model.parameters()))
    for tokens, targets in batches():
        model.step(tokens, targets)
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    # Every collective (full_tensor) first, the comparisons after: a rank that fails an
    # assertion must not leave its peers waiting in a gather.
    pairs, worst = against_reference(model, opt, reference, ref_opt)
    everywhere: list[Any] = [None] * ws
    dist.all_gather_object(everywhere, worst)
    if rank == 0:
        merged = {k: max(w[k] for w in everywhere) for k in worst}
        Path(directory, f"{name}.json").write_text(json.dumps(merged))
    assert_close_pairs(pairs, name)


def raises_naming(fn: Any, *needles: str) -> str:
    try:
        fn()
    except ValueError as err:
        message = str(err)
        for needle in needles:
            assert needle in message, f"{needle!r} not in {message!r}"
        return message
    raise AssertionError(f"no ValueError (wanted one naming {needles})")


def same_everywhere(message: str) -> None:
    everywhere: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everywhere, message)
    assert len(set(everywhere)) == 1, everywhere


def check_agreement(rank: int, ws: int) -> None:
    """A rank started with another topology, or another model, gets the same sentence as
    every other rank from parallelize, before any group is made (no hang)."""
    topology = Topology.create(ws, tp=2, pp=2)
    other = Topology.create(ws, tp=2, cp=2) if rank == 5 else topology
    message = raises_naming(
        lambda: parallelize(Llama(DENSE), other, ParallelOptions(), seq_len=SEQ),
        "another topology",
        "rank 5",
    )
    same_everywhere(message)
    config = LlamaConfig(**{**DENSE.__dict__, "n_layers": 2}) if rank == 2 else DENSE
    message = raises_naming(
        lambda: parallelize(Llama(config), topology, ParallelOptions(), seq_len=SEQ),
        "another config",
        "rank 2",
    )
    same_everywhere(message)


def check_refusals(rank: int, ws: int) -> None:
    """Compositions parallelize does not lay out: one sentence on every rank."""
    cases = [
        (MOE, Topology.create(ws, tp=2, ep=2), "MoE variant under tp=2"),
        (
            LlamaConfig(**{**MOE.__dict__, "n_experts": 8}),
            Topology.create(ws, ep=8),
            "fully_shard has no expert data-parallel group",
        ),
        (
            LlamaConfig(**{**DENSE.__dict__, "tie_embeddings": True}),
            Topology.create(ws, pp=2),
            "tied embedding under pp > 1",
        ),
        (DENSE, Topology.create(ws, tp=8), "n_heads 4 is not divisible by tp=8"),
    ]
    for config, topology, needle in cases:
        message = raises_naming(
            lambda c=config, t=topology: parallelize(Llama(c), t, seq_len=SEQ), needle
        )
        same_everywhere(message)
