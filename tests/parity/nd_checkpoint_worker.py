"""A gloo rank of tests/parity/test_cross_nd_checkpoint.py: it loads a checkpoint the JAX
composition saved (``ParallelLlama.save`` of examples/llama_nnx.py) under a torch layout of
``examples/llama_torch.py`` (``gradsync_torch.checkpoint.load_boxes``), trains the remaining
steps, and compares its pieces of the parameters and AdamW moments with torch's uninterrupted
run on one process from the same initial weights. This module holds no tests of its own.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, lm_loss_share, parallelize
from gradsync_core import Topology
from gradsync_torch.checkpoint import load_boxes
from tests.torch.nd_checks import against_reference


def _adamw(params: Any, lr: float, eps: float) -> torch.optim.Optimizer:
    """optax.adamw(lr, eps=eps)'s counterpart (optax's default weight decay, 1e-4)."""
    return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=1e-4, foreach=False)


def continue_in_torch(
    rank: int,
    ws: int,
    path: str,
    config: LlamaConfig,
    sizes: dict[str, Any],
    options: ParallelOptions,
    initial: dict[str, np.ndarray],
    data: list[tuple[np.ndarray, np.ndarray]],
    saved: int,
    hyper: dict[str, float],
    rtol: float,
) -> dict[str, float]:
    """Load ``path`` under ``sizes`` on ``ws`` ranks, train ``data[saved:]``, compare with
    torch's one-process run of all of ``data`` from ``initial`` (within ``rtol`` of each
    tensor's largest entry). Returns the largest relative difference of each kind."""
    batches = [(torch.from_numpy(t).long(), torch.from_numpy(y).long()) for t, y in data]
    topology = Topology.create(ws, **sizes)
    seq = batches[0][0].shape[1]
    model = parallelize(Llama(config, seed=3), topology, options, seq_len=seq)
    opt = _adamw(list(model.parameters()), hyper["lr"], hyper["eps"])
    manifest = load_boxes(path, model.held(), opt, specs=model.specs())
    assert (manifest.framework, manifest.step) == ("jax", saved), manifest
    for tokens, targets in batches[saved:]:
        model.step(tokens, targets)
        model.clip_grad_norm_(hyper["max_norm"])
        opt.step()
        opt.zero_grad()
    reference = Llama(config)
    reference.load_state_dict({k: torch.from_numpy(v) for k, v in initial.items()})
    ref_opt = _adamw(reference.parameters(), hyper["lr"], hyper["eps"])
    for tokens, targets in batches:
        lm_loss_share(reference(tokens), targets, tokens.numel()).backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), hyper["max_norm"])
        ref_opt.step()
        ref_opt.zero_grad()
    pairs, _ = against_reference(model, opt, reference, ref_opt)  # a collective: first
    worst = {"params": 0.0, "exp_avg": 0.0, "exp_avg_sq": 0.0}
    for kind, pname, actual, expected in pairs:
        scale = float(expected.abs().max()) or 1.0
        error = float((actual - expected).abs().max()) / scale
        worst[kind] = max(worst[kind], error)
        assert error <= rtol, f"rank {rank}: {kind} of {pname} differs by {error:.2e} (relative)"
    return worst
