"""Gradient accumulation without communication: the JAX twin of DDP's ``no_sync()``.

``k`` micro-steps run in a ``lax.scan`` on each device and sum LOCAL gradients; the caller
then syncs once (``sync_gradients``), so the program holds the collectives of one step, not
``k`` (docs/design.md §7; tests count them in the compiled HLO).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradsync_jax._axes import AxisName
from gradsync_jax.data_parallel.sync import value_and_local_grad


def split_microbatches(batch: Any, steps: int) -> Any:
    """Reshape every leaf ``(B, ...)`` of ``batch`` to ``(steps, B // steps, ...)``.

    Raises:
        ValueError: if a leaf's leading dimension is not a multiple of ``steps``.
    """
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")

    def split(leaf: Any) -> Any:
        if leaf.ndim == 0 or leaf.shape[0] % steps:
            raise ValueError(
                f"a batch leaf of shape {leaf.shape} cannot be split into {steps} micro-steps; "
                f"its leading (batch) dimension must be a multiple of {steps}"
            )
        return leaf.reshape(steps, leaf.shape[0] // steps, *leaf.shape[1:])

    return jax.tree.map(split, batch)


def accumulate_local_grads(
    loss_fn: Callable[[Any, Any], jax.Array],
    params: Any,
    batch: Any,
    steps: int,
    *,
    axis_name: AxisName = "dp",
) -> tuple[jax.Array, Any]:
    """Mean loss and mean LOCAL gradient over ``steps`` micro-batches of ``batch``.

    Call inside ``shard_map``/``pmap``; no collective runs here. Gradients are averaged over
    the micro-steps (optax.MultiSteps' convention), so with equal micro-batches the result
    equals one step on the whole local batch. Sync the result with ``sync_gradients``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean over its batch.
        params: the parameters (replicated or already local).
        batch: a pytree whose leaves have a leading batch dimension divisible by ``steps``.
        steps: number of micro-steps ``k``.
        axis_name: the data-parallel axis the gradients must stay local over.

    Returns:
        ``(loss, grads)``: this device's mean loss and mean local gradients.

    Example:
        >>> loss, grads = accumulate_local_grads(loss_fn, params, batch, 4)
        >>> grads = sync_gradients(grads, "dp")  # the only collective
    """
    grad_fn = value_and_local_grad(loss_fn, axis_name=axis_name)
    if steps == 1:
        return grad_fn(params, batch)
    micro = split_microbatches(batch, steps)

    def body(carry: tuple[jax.Array, Any], mb: Any) -> tuple[tuple[jax.Array, Any], None]:
        loss_sum, grad_sum = carry
        loss, grads = grad_fn(params, mb)
        return (loss_sum + loss, jax.tree.map(jnp.add, grad_sum, grads)), None

    # The first micro-step seeds the carry, so its type (dtype and variance over every mesh
    # axis) is exactly what the scan body returns.
    first = grad_fn(params, jax.tree.map(lambda leaf: leaf[0], micro))
    rest = jax.tree.map(lambda leaf: leaf[1:], micro)
    (loss_sum, grad_sum), _ = lax.scan(body, first, rest)
    return loss_sum / steps, jax.tree.map(lambda g: g / steps, grad_sum)
