"""The six model-parallel mappings for ``jax.shard_map`` (docs/design.md §6), same names as torch.

No ``custom_vjp``: under ``check_vma=True`` JAX's own transposes ARE Megatron's operators
(arXiv:1909.08053 §3, arXiv:2205.05198 §4.2), so plain autodiff is both correct and simplest:

==================  ==========================================  =========================
mapping             forward (types: invariant I / varying V)    backward (JAX transpose)
==================  ==========================================  =========================
copy_to             ``pcast`` I -> V, identity                   ``psum``: all-reduce
reduce_from         ``psum`` V -> I, all-reduce                  ``pcast``: identity
scatter_to          own chunk of an I value -> V                 all-gather (``psum`` of
                                                                 zero-padded chunks)
gather_from         ``all_gather(to="invarying")`` V -> I        own chunk: split
reduce_scatter_to   ``psum_scatter`` V -> V                      ``all_gather``
all_gather_from     ``all_gather`` V -> V                        ``psum_scatter``
==================  ==========================================  =========================

A ``custom_vjp`` would be worse: copy_to returning an invariant value would make JAX insert
its own broadcast downstream, whose transpose sums a second time. The types also make
misuse loud: ``copy_to`` of a value that already varies is an error, not a silent no-op.

Uneven splits (``split_shapes``): every device of a ``shard_map`` holds the same shape, so a
chunk is stored padded with zeros to the largest chunk, ``max(split_shapes(size, n))``;
``gather_from``/``all_gather_from`` need ``size`` to drop the padding. On a group of one
device every mapping is the identity.

``axis`` is a mesh axis name, a tuple of them in mesh order, or a gradsync group name
(``"tp-cp"``), resolved against the mesh ``shard_map`` runs over.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradsync_core import split_shapes
from gradsync_jax._axes import AxisName, tracks_variance, varying


def group_axes(axis: AxisName) -> tuple[str, ...]:
    """Mesh axis names of ``axis``; a group name ``"tp-cp"`` becomes ``("cp", "tp")``.

    Raises:
        ValueError: if a name is not an axis of the current mesh.
    """
    if isinstance(axis, str):
        names = tuple(axis.split("-"))
    elif isinstance(axis, tuple) and axis and all(isinstance(a, str) for a in axis):
        names = axis
    else:
        raise ValueError(f"axis must be a mesh axis name or a tuple of them, got {axis!r}")
    order = tuple(jax.sharding.get_abstract_mesh().axis_names)
    unknown = [a for a in names if a not in order]
    if unknown:
        raise ValueError(
            f"axis {axis!r}: {unknown} not in the mesh axes {order}; call the mappings inside "
            "jax.shard_map over a mesh with those axes (gradsync_jax.mesh_from_topology)"
        )
    if isinstance(axis, str) and len(names) > 1:
        names = tuple(sorted(names, key=order.index))
    return names


def _group(axis: AxisName, who: str) -> tuple[tuple[str, ...], int]:
    """(mesh axes, group size); checks that JAX tracks variance (the transposes need it)."""
    axes = group_axes(axis)
    n = math.prod(lax.axis_size(a) for a in axes)
    if n > 1 and not tracks_variance(axes):
        raise ValueError(
            f"{who} needs jax.shard_map(..., check_vma=True) (the default): its backward "
            "is JAX's transpose of a typed collective, which check_vma=False changes"
        )
    return axes, n


def _valid(sizes: tuple[int, ...]) -> np.ndarray:
    """Positions of real elements in the padded layout (chunk r at r*max(sizes))."""
    width = max(sizes)
    return np.concatenate([r * width + np.arange(s) for r, s in enumerate(sizes)])


def _pad(x: jax.Array, dim: int, sizes: tuple[int, ...]) -> jax.Array:
    """Lay ``x`` out as ``len(sizes)`` chunks of ``max(sizes)``, zero-padded."""
    if len(set(sizes)) == 1:
        return x
    source = np.full(len(sizes) * max(sizes), x.shape[dim])  # index of an appended zero
    source[_valid(sizes)] = np.arange(x.shape[dim])
    zero = jnp.zeros_like(lax.slice_in_dim(x, 0, 1, axis=dim))
    return jnp.take(jnp.concatenate([x, zero], axis=dim), source, axis=dim)


def _trim(x: jax.Array, dim: int, sizes: tuple[int, ...]) -> jax.Array:
    return x if len(set(sizes)) == 1 else jnp.take(x, _valid(sizes), axis=dim)


def _gather_sizes(x: jax.Array, dim: int, size: int | None, n: int, who: str) -> tuple[int, ...]:
    width = x.shape[dim]
    if size is None:
        return (width,) * n
    sizes = split_shapes(size, n)
    if max(sizes) != width:
        raise ValueError(
            f"{who}: chunks of a dim of {size} over {n} devices are {sizes}, stored padded to "
            f"{max(sizes)}, but x has {width} along dim {dim}; pass the full size of that dim"
        )
    return sizes


def copy_to(x: jax.Array, axis: AxisName) -> jax.Array:
    """Enter a parallel region: identity forward, all-reduce backward (Megatron's ``f``).

    ``x`` must be invariant (replicated) over ``axis``.

    Raises:
        ValueError: if ``x`` already varies over ``axis``.

    Example:
        >>> h = copy_to(x, "tp") @ kernel_shard  # inside jax.shard_map
    """
    axes, n = _group(axis, "copy_to")
    if n == 1:
        return x
    if set(axes) & varying(x):
        raise ValueError(
            f"copy_to: x already varies over {sorted(set(axes) & varying(x))}; copy_to enters "
            "a region from a value replicated over the group (drop copy_to, or reduce first)"
        )
    return lax.pcast(x, axes, to="varying")


def reduce_from(x: jax.Array, axis: AxisName) -> jax.Array:
    """Leave a parallel region: all-reduce forward, identity backward (Megatron's ``g``)."""
    axes, n = _group(axis, "reduce_from")
    return x if n == 1 else lax.psum(x, axes)


def scatter_to(x: jax.Array, axis: AxisName, *, dim: int = -1) -> jax.Array:
    """This device's ``split_shapes`` chunk of ``x`` along ``dim`` (zero-padded if uneven).

    Backward all-gathers the chunks' gradients (padding dropped).
    """
    axes, n = _group(axis, "scatter_to")
    if n == 1:
        return x
    dim %= x.ndim
    sizes = split_shapes(x.shape[dim], n)
    start = lax.axis_index(axes) * max(sizes)
    return lax.dynamic_slice_in_dim(_pad(x, dim, sizes), start, max(sizes), axis=dim)


def gather_from(
    x: jax.Array, axis: AxisName, *, dim: int = -1, size: int | None = None
) -> jax.Array:
    """Concatenate every device's chunk along ``dim`` into a replicated value; backward splits.

    Args:
        x: this device's chunk, padded to the largest chunk if the split is uneven.
        axis: the group.
        dim: the dimension to concatenate.
        size: the full size of ``dim`` (needed for uneven splits); default ``n * x.shape[dim]``.

    Raises:
        ValueError: if ``x.shape[dim]`` is not ``max(split_shapes(size, n))``.
    """
    axes, n = _group(axis, "gather_from")
    if n == 1:
        return x
    dim %= x.ndim
    sizes = _gather_sizes(x, dim, size, n, "gather_from")
    full = lax.all_gather(x, axes, axis=dim, tiled=True, to="invarying")
    return _trim(full, dim, sizes)


def reduce_scatter_to(x: jax.Array, axis: AxisName, *, dim: int = 0) -> jax.Array:
    """Sum ``x`` over ``axis`` and keep this device's chunk along ``dim``; backward all-gathers."""
    axes, n = _group(axis, "reduce_scatter_to")
    if n == 1:
        return x
    dim %= x.ndim
    sizes = split_shapes(x.shape[dim], n)
    return lax.psum_scatter(_pad(x, dim, sizes), axes, scatter_dimension=dim, tiled=True)


def all_gather_from(
    x: jax.Array, axis: AxisName, *, dim: int = 0, size: int | None = None
) -> jax.Array:
    """All-gather chunks along ``dim``; backward reduce-scatters (sequence parallelism).

    The result varies over ``axis`` (it feeds device-specific computation, e.g. a
    column-parallel layer), so its gradients are partial and summed. ``size`` as in
    ``gather_from``.
    """
    axes, n = _group(axis, "all_gather_from")
    if n == 1:
        return x
    dim %= x.ndim
    sizes = _gather_sizes(x, dim, size, n, "all_gather_from")
    return _trim(lax.all_gather(x, axes, axis=dim, tiled=True), dim, sizes)
