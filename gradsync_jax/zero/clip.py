"""Global-norm clipping that sees the whole gradient when the optimizer state is sharded.

Inside ``shard_optimizer`` each device runs the inner transformation on its share of the
gradient only, so ``optax.clip_by_global_norm`` would clip each share by that share's norm.
``clip_by_global_norm`` here takes the norm across all devices, which ``shard_optimizer``
computes once (one scalar ``psum``) and hands over through a context while the inner update is
traced; without ``shard_optimizer`` it is exactly ``optax.clip_by_global_norm``.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax


@dataclass(frozen=True)
class ShardContext:
    """What ``shard_optimizer`` tells the transformations it wraps while tracing them."""

    grads: tuple[Any, ...]  # the gradient leaves handed to the inner update (identity check)
    norm: jax.Array | None  # the global norm of the reduced gradient, over all devices
    asked: list[bool]  # appended to when a transformation reads ``norm``

    def global_norm(self) -> jax.Array:
        self.asked.append(True)
        if self.norm is None:
            raise RuntimeError("gradsync internal error: the global norm was not computed")
        return self.norm


_CONTEXT: contextvars.ContextVar[ShardContext | None] = contextvars.ContextVar(
    "gradsync_shard_context", default=None
)


@contextlib.contextmanager
def shard_context(
    grads: Any, norm: jax.Array | None, asked: list[bool] | None = None
) -> Iterator[None]:
    """Trace the inner update with the cross-device gradient norm at hand.

    ``shard_optimizer`` computes the norm (one scalar psum) only when a trial trace shows that
    a transformation reads it (``asked``): an unused psum cannot always be removed by XLA.
    """
    context = ShardContext(
        grads=tuple(jax.tree.leaves(grads)), norm=norm, asked=[] if asked is None else asked
    )
    token = _CONTEXT.set(context)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformation:
    """Clip the gradient by its global norm, across devices under ``shard_optimizer``.

    Put it first in the chain wrapped by ``shard_optimizer`` (where Optax examples put
    clipping): it must see the gradient itself, and it raises if another transformation
    runs before it. Outside ``shard_optimizer`` it equals ``optax.clip_by_global_norm``.

    Args:
        max_norm: the largest global norm an update may have.

    Returns:
        An ``optax.GradientTransformation`` with an empty state.

    Raises:
        ValueError: (when traced under ``shard_optimizer``) if it does not receive the
            gradient as ``shard_optimizer`` passed it, i.e. it is not first in the chain.

    Example:
        >>> tx = shard_optimizer(optax.chain(clip_by_global_norm(1.0), optax.adam(1e-3)), mesh)
    """

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        context = _CONTEXT.get()
        if context is None:
            g_norm = optax.tree.norm(updates)
        else:
            leaves = jax.tree.leaves(updates)
            if len(leaves) != len(context.grads) or any(
                a is not b for a, b in zip(leaves, context.grads, strict=True)
            ):
                raise ValueError(
                    "gradsync_jax.clip_by_global_norm must be the first transformation in the "
                    "chain wrapped by shard_optimizer: it clips the gradient by the norm of the "
                    "whole gradient across devices, which is known only for the gradient itself"
                )
            g_norm = context.global_norm()
        # The same arithmetic as optax.clip_by_global_norm, so the unsharded run matches.
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip_fn, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update_fn)
