"""Flax models and parameter trees shared by the JAX and cross-framework tests."""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx


class LinenMLP(fnn.Module):
    """Dense layers of ``widths`` (``Dense_0`` ...) with tanh between them: the Linen twin of
    tests/parity/torch_worker.py's ``TorchMLP(widths)``."""

    widths: Sequence[int]

    @fnn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        for i, width in enumerate(self.widths[1:]):
            x = fnn.Dense(width)(x)
            if i < len(self.widths) - 2:
                x = jnp.tanh(x)
        return x


class NnxMLP(nnx.Module):
    """The NNX twin of ``LinenMLP``: ``layers`` of ``nnx.Linear`` (its parameters only; the
    tests compare plans and names, not outputs)."""

    def __init__(self, widths: Sequence[int], rngs: nnx.Rngs) -> None:
        self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(widths)])


def random_params(shapes: Mapping[str, Any], seed: int = 0, std: float = 0.5) -> Any:
    """A float32 tree of ``shapes`` (a tree of shape tuples) drawn from ``N(0, std)``, leaves in
    ``jax.tree`` order (sorted keys)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda s: jnp.asarray(rng.normal(0, std, s), jnp.float32),
        shapes,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def mean_in_device_order(stacked: Any, n: int) -> Any:
    """The mean over the leading axis of every leaf, summed device 0, 1, ... ``n - 1`` (each term
    divided first): the order and rounding of the sharded step's mean, for bitwise references."""

    def mean(x: jax.Array) -> jax.Array:
        total = x[0] / n
        for d in range(1, n):
            total = total + x[d] / n
        return total

    return jax.tree.map(mean, stacked)
