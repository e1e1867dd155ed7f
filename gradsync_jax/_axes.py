"""Mesh-axis helpers, variance tracking and the divide-after-sum rule (docs/design.md §7).

One home for what the data-parallel sync, the training step, the sharded optimizer and the
model-parallel mappings all need: normalising an axis argument, asking JAX which manual axes a
value varies over, and taking a mean where the core's rule ``mean_divisors(dtype, n,
"after")`` divides (gradsync_core/plan/_mean.py, the one home of the mean's rules).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax import lax

from gradsync_core.plan import divides_after, mean_divisors

AxisName = str | tuple[str, ...]


def axis_tuple(axis_name: AxisName) -> tuple[str, ...]:
    """``"dp"`` -> ``("dp",)``; a tuple of names is kept as given.

    Raises:
        ValueError: if ``axis_name`` is neither a name nor a non-empty tuple of names.
    """
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if not axes or not all(isinstance(a, str) for a in axes):
        raise ValueError(
            f"axis_name must be a mesh axis name or a tuple of them, got {axis_name!r}"
        )
    return axes


def display_axis(axes: tuple[str, ...]) -> str | tuple[str, ...]:
    """How an error message names ``axes``: ``"dp"`` for one axis, the tuple otherwise."""
    return axes[0] if len(axes) == 1 else axes


def spec_entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (``None``, a name or a tuple of names)."""
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def varying(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over (its "vma"); empty outside ``shard_map``.

    Inside ``jax.shard_map(check_vma=True)`` a value is either the same on every device of an
    axis (invariant) or may differ (varying); a gradient must be summed over the axes its
    parameter is invariant over and the data varies over.

    Args:
        x: an array or tracer.

    Returns:
        The names of the mesh axes ``x`` varies over.
    """
    aval = jax.typeof(x)
    mat = getattr(aval, "mat", None)  # jax >= 0.9: ShapedArray.mat.varying
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))  # jax 0.6 - 0.8


def tracks_variance(axes: tuple[str, ...]) -> bool:
    """True inside ``shard_map(check_vma=True)`` over ``axes``; False in pmap / check_vma=False.

    ``axis_index`` varies over its axis exactly when JAX tracks variance.

    Raises:
        NameError: if an axis is not bound (called outside ``shard_map``/``pmap``).
    """
    try:
        index = lax.axis_index(axes)
    except NameError as err:
        raise NameError(
            f"axis {display_axis(axes)!r} is not bound here: gradsync's collectives run "
            "inside jax.shard_map over a mesh with that axis, or inside "
            "jax.pmap(..., axis_name=...); call this function from the mapped function"
        ) from err
    return set(axes) <= varying(index)


def cast_varying(tree: Any, axes: tuple[str, ...]) -> Any:
    """Mark every leaf of ``tree`` varying over ``axes`` (``lax.pcast``); leaves that already
    vary are kept. The identity where JAX does not track variance.

    Call it inside ``jax.shard_map`` where a value computed the same on every device of
    ``axes`` meets values that differ (a ``lax.cond`` branch, a loop carry, a pipeline
    stage's input).

    Args:
        tree: a pytree of arrays.
        axes: the mesh axes to mark the leaves varying over (bound by the enclosing map).

    Returns:
        ``tree`` with every leaf varying over at least ``axes``.

    Raises:
        NameError: if an axis is not bound (called outside ``shard_map``/``pmap``).
    """
    if not tracks_variance(axes):
        return tree

    def cast(leaf: Any) -> Any:
        missing = tuple(a for a in axes if a not in varying(leaf))
        return lax.pcast(leaf, missing, to="varying") if missing else leaf

    return jax.tree.map(cast, tree)


def dtype_name(dtype: Any) -> str:
    """``jnp.bfloat16`` -> ``"bfloat16"`` (the spelling gradsync_core uses)."""
    return np.dtype(dtype).name


def divide_after(dtype: Any, n: int) -> bool:
    """True when a mean over ``n`` devices may divide the SUM instead of every summand (the
    core's ``divides_after``, the ``"after"`` rule of ``mean_divisors``).

    DDP divides before the sum (docs/design.md §7) so a narrow sum cannot overflow. Dividing
    after gives the same bits when both hold:

    - ``n`` is a power of two: scaling by ``2**-k`` is exact and commutes with rounding, so
      ``sum(x / n) == sum(x) / n`` (short of subnormals, where dividing last is the more
      accurate);
    - the dtype's exponent range is float32's or wider (float32, float64, bfloat16): a sum of
      ``n`` values that each fit cannot overflow, while float16 (largest 65504) can.

    Dividing after is cheaper: a pass over 1/n of the gradient after a reduce-scatter, or one
    XLA fuses into the consumer after an all-reduce, instead of a pass over all of it.

    Example:
        >>> divide_after(jnp.bfloat16, 8), divide_after(jnp.float16, 8), divide_after("float32", 3)
        (True, False, False)
    """
    return divides_after(dtype_name(dtype), n)


def psum_mean(x: Any, axes: tuple[str, ...], *, mean: bool) -> Any:
    """All-reduce ``x`` over ``axes``: the sum, or with ``mean`` the mean (the ``"after"``
    rule: ``divide_after``). ``x`` is an array or a tuple of arrays of one dtype, reduced by
    one ``psum`` with no copy into a flat buffer (JAX lowers an all-reduce per operand, which
    XLA's all-reduce combiner merges)."""
    if not mean:
        return lax.psum(x, axes)
    dtype = jax.tree.leaves(x)[0].dtype
    rule = mean_divisors(dtype_name(dtype), lax.axis_size(axes), "after")
    pre, post = rule.pre, rule.post
    out = lax.psum(x if pre is None else jax.tree.map(lambda a: a / pre, x), axes)
    return out if post is None else jax.tree.map(lambda a: a * (1.0 / post), out)


def psum_scatter_mean(buf: jax.Array, axes: tuple[str, ...], n: int, *, mean: bool) -> jax.Array:
    """Sum ``buf`` (leading dimension a multiple of ``n``) over ``axes`` and keep this device's
    chunk, divided by ``n`` with ``mean`` (the ``"after"`` rule: ``divide_after``)."""
    rule = mean_divisors(dtype_name(buf.dtype), n, "after") if mean else None
    if rule is not None and rule.pre is not None:
        buf = buf / rule.pre
    out = lax.psum_scatter(buf, axes, scatter_dimension=0, tiled=True)
    return out if rule is None or rule.post is None else out / rule.post
