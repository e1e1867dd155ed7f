"""Global-norm clipping that sees the whole gradient when the optimizer state is sharded.

Inside ``shard_optimizer`` each device runs the inner transformation on its share of the
gradient only, so ``optax.clip_by_global_norm`` would clip each share by that share's norm.
``clip_by_global_norm`` here takes the norm across all devices, which ``shard_optimizer``
computes once (one scalar ``psum``) and passes to the inner update as the Optax extra argument
``global_norm`` (a ``GlobalNorm``); without ``shard_optimizer`` it is exactly
``optax.clip_by_global_norm``. Under ``zero3_step`` no ``global_norm`` is passed: the step
completes the norm's per-tensor sums across the devices, as it does Optax's
(``param_sharding/update.py``).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

GLOBAL_NORM = "global_norm"  # the extra argument's name


class GlobalNorm(NamedTuple):
    """The extra argument ``global_norm`` that ``shard_optimizer`` hands its inner update."""

    value: jax.Array  # the global norm of the reduced gradient, over all devices
    of: tuple[Any, ...]  # the gradient leaves it is the norm of (identity check)


def global_norm_args(grads: Any, norm: jax.Array) -> dict[str, GlobalNorm]:
    """The extra arguments that tell the inner update the global norm of ``grads``.

    Where the gradient is cut into chunks over devices (a ``shard_map`` that keeps each
    device's chunk), pass them to an update whose ``clip_by_global_norm`` must clip by the
    norm of the whole gradient, not of this device's chunks:
    ``tx.update(grads, state, params, **global_norm_args(grads, norm))`` with ``tx`` wrapped
    by ``optax.with_extra_args_support``.

    Args:
        grads: the gradient pytree the update receives (the same leaves, in the same order).
        norm: the 2-norm of the whole gradient over every device (the same on each).

    Returns:
        ``{"global_norm": GlobalNorm(norm, leaves of grads)}``.
    """
    return {GLOBAL_NORM: GlobalNorm(value=norm, of=tuple(jax.tree.leaves(grads)))}


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """Clip the gradient by its global norm, across devices under ``shard_optimizer``.

    First in the chain wrapped by ``shard_optimizer`` (where Optax examples put clipping)
    it keeps a ``flat`` or ``greedy`` partition: it is handed the norm across devices, which
    is known only for the gradient itself, and it raises there if another transformation
    runs before it. Anywhere else (after other transformations, inside ``MultiSteps`` or
    ``multi_transform``) ``partition="auto"`` runs the update ``gathered``, where no
    ``global_norm`` is passed. Without a ``global_norm`` extra argument (also outside
    ``shard_optimizer``) it equals ``optax.clip_by_global_norm``.

    Args:
        max_norm: the largest global norm an update may have.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` with an empty state; its update reads
        the extra argument ``global_norm`` (a ``GlobalNorm``) when given.

    Raises:
        ValueError: (traced under a ``greedy`` or ``flat`` ``shard_optimizer``) if it does
            not receive the gradient as ``shard_optimizer`` passed it (not first in the chain).

    Example:
        >>> tx = shard_optimizer(optax.chain(clip_by_global_norm(1.0), optax.adam(1e-3)), mesh)
    """

    def update_fn(
        updates: Any,
        state: Any,
        params: Any = None,
        *,
        global_norm: GlobalNorm | None = None,
        **extra_args: Any,
    ) -> tuple[Any, Any]:
        del params, extra_args
        if global_norm is None:
            g_norm = optax.tree.norm(updates)
        else:
            leaves = jax.tree.leaves(updates)
            if len(leaves) != len(global_norm.of) or any(
                a is not b for a, b in zip(leaves, global_norm.of, strict=True)
            ):
                raise ValueError(
                    "gradsync_jax.clip_by_global_norm must be the first transformation in the "
                    "chain wrapped by shard_optimizer: it clips the gradient by the norm of the "
                    "whole gradient across devices, which is known only for the gradient itself"
                )
            g_norm = global_norm.value
        # The same arithmetic as optax.clip_by_global_norm, so the unsharded run matches.
        trigger = jnp.squeeze(g_norm < max_norm)

        def clip_fn(t: jax.Array) -> jax.Array:
            return jax.lax.select(trigger, t, (t / g_norm.astype(t.dtype)) * max_norm)

        return jax.tree.map(clip_fn, updates), state

    return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)
