"""The torch side of test_cross_param_shards.py: ``fully_shard`` (ZeRO-3) training that saves.

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns). The model,
its units and the training are tests/torch/test_fully_shard_checkpoint.py's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tests.torch.test_fully_shard_checkpoint import _sharded, _state, _train


def save_zero3(
    rank: int, world_size: int, tokens: np.ndarray, labels: np.ndarray, path: str, steps: int
) -> dict[str, Any]:
    """Train ``TiedLM`` under ``fully_shard`` for ``steps`` steps at ``world_size`` ranks and
    save it (``save_param_shards``). Returns (rank 0) the state saved, in model space, and
    the plan's fingerprint and JSON (the root's ``shard_plan``)."""
    from gradsync_torch.checkpoint.param_shards import save_param_shards

    model, opt = _sharded(0)
    _train(model, opt, tokens, labels, steps, rank, world_size)
    save_param_shards(path, model, opt)
    saved = _state(model, opt)  # a collective: every rank gathers
    if rank != 0:
        return {}
    plan = model.shard_plan
    return {**saved, "fingerprint": plan.fingerprint, "plan": plan.to_json()}
