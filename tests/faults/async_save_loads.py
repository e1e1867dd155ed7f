"""How the torch tests of saves in the background check a checkpoint
(test_async_torch_faults.py, tests/torch/test_preemption.py): read back bitwise by a plain
torch Adam at world size 1 and by ``optax.adam`` in JAX. Apart from async_save_faults.py,
whose functions run in the spawned ranks, so that those never import JAX."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np
import optax

from gradsync_jax import load_optimizer_state, to_torch_state
from tests.torch.async_save_checks import assert_same, linear_stack, plain_state


def jax_like(*sizes: int) -> dict[str, dict[str, np.ndarray]]:
    """The JAX tree of ``nn.Sequential`` of Linear layers (widths ``sizes``) with one
    activation between each, under torch's names ("0", "2", ...)."""
    return {
        str(2 * i): {
            "kernel": np.zeros((n_in, n_out), np.float32),
            "bias": np.zeros(n_out, np.float32),
        }
        for i, (n_in, n_out) in enumerate(itertools.pairwise(sizes))
    }


JAX_LIKE = jax_like(16, 32, 24, 8)  # tests/torch/async_save_checks.py's linear_model


def jax_state(path: str | Path, like: Any = None) -> dict[str, np.ndarray]:
    """The checkpoint loaded into ``optax.adam`` in JAX, by torch ``"<name>/<key>"``."""
    state, _ = load_optimizer_state(path, optax.adam(1e-2), JAX_LIKE if like is None else like)
    adam = state[0]
    out: dict[str, np.ndarray] = {}
    for key, tree in (("exp_avg", adam.mu), ("exp_avg_sq", adam.nu)):
        for name, value in to_torch_state(tree).items():
            out[f"{name}/{key}"] = np.asarray(value)
            out[f"{name}/step"] = np.asarray(adam.count, np.float32)
    return out


def assert_loads_everywhere(
    path: str | Path, saved: dict[str, np.ndarray], what: str, *sizes: int
) -> None:
    """``path`` holds ``saved`` bitwise, read by a plain torch Adam at world size 1 and by
    ``optax.adam`` in JAX; ``sizes``: the Linear widths of a model other than
    ``linear_model``'s."""
    model = linear_stack(*sizes) if sizes else None
    like = jax_like(*sizes) if sizes else None
    assert_same(plain_state(str(path), model), saved, f"{what}: torch, world size 1")
    assert_same(jax_state(path, like), saved, f"{what}: JAX")
