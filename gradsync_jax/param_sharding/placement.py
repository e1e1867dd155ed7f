"""Parameters to and from their sharded form: each device's padded dim-0 chunk (ZeRO-3).

A sharded leaf is one global array of shape ``(N * c, *rest)`` in torch's layout, split
``P(axis)`` over the data-parallel axis, so device ``r`` holds rows ``[r*c, (r+1)*c)``: its
``chunk_rows`` rows and zero padding. Padding to ``N * c`` is what lets uneven dims (and dims
smaller than ``N``) be placed at all: ``NamedSharding`` refuses a dim the axis does not divide.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core.plan import HSDP_AXES
from gradsync_jax._axes import AxisName, axis_tuple
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout


def _is_none(x: Any) -> bool:
    return x is None


def flat_leaves(tree: Any, layout: ParamLayout, what: str) -> list[Any]:
    """``tree``'s leaves (``None`` kept where a leaf is absent) aligned with ``layout.leaves``.

    Raises:
        ValueError: if ``tree`` has another number of leaves than the layout's parameters.
    """
    leaves = jax.tree_util.tree_leaves(tree, is_leaf=_is_none)
    if len(leaves) != len(layout.leaves):
        raise ValueError(
            f"{what} has {len(leaves)} leaves but the layout has {len(layout.leaves)} "
            "parameters; pass the tree the layout was made from (param_layout)"
        )
    return leaves


def axis_size(mesh: Mesh, axis_name: AxisName) -> int:
    """Devices along ``axis_name`` (a name or a tuple of names) of ``mesh``."""
    axes = axis_tuple(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis {missing[0]!r} is not an axis of the mesh {mesh.axis_names}")
    return int(np.prod([mesh.shape[a] for a in axes]))


def split_axes(
    layout: ParamLayout, mesh: Mesh, axis_name: AxisName
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the axes ``layout`` cuts the parameters over, the axes it replicates them over).

    ``"dp"`` on the mesh of a hybrid-sharding topology (``mesh_from_topology`` of a
    ``Topology`` with ``dp_shard < dp``, whose mesh has ``"dp_replicate"`` and ``"dp_shard"``
    in place of ``"dp"``) names those two axes, as ``Topology.mesh_axes("dp")`` does: a
    layout planned with the topology's ``dp_shard`` (``plan.replicate_size > 1``) is cut over
    ``"dp_shard"`` and replicated over ``"dp_replicate"``, one planned without over both.
    Any other ``axis_name`` is cut over as given, replicated over nothing.
    """
    axes = axis_tuple(axis_name)
    split = "dp" not in mesh.axis_names and set(HSDP_AXES) <= set(mesh.axis_names)
    if axes != ("dp",) or not split:
        return axes, ()
    replicate, shard = ("dp_replicate",), ("dp_shard",)
    if layout.plan.replicate_size == 1:
        return replicate + shard, ()
    return shard, replicate


def check_mesh(layout: ParamLayout, mesh: Mesh, axis_name: AxisName) -> tuple[str, ...]:
    """The axes the parameters are cut over (``split_axes``), after checking the layout was
    planned for this many devices."""
    axes = split_axes(layout, mesh, axis_name)[0]
    n = axis_size(mesh, axes)
    if n != layout.world_size:
        shown = axis_name if axes == axis_tuple(axis_name) else axes
        replicas = layout.plan.replicate_size
        fix = f"world_size={n}" if replicas == 1 else f"world_size=..., dp_shard={n}"
        raise ValueError(
            f"the layout was planned for {layout.world_size} devices but the mesh axis "
            f"{shown!r} has {n}; make it with param_layout(params, {fix})"
        )
    return axes


def padded_host(leaf: LeafLayout, value: Any, n: int) -> np.ndarray:
    """A Flax-layout host array in torch's layout, dim 0 zero padded to ``n`` chunks."""
    array = np.asarray(value)
    if array.shape != leaf.shape:
        raise ValueError(f"{leaf.flax_name!r} has shape {array.shape}, the layout {leaf.shape}")
    array = np.transpose(array, leaf.perm)
    pad = n * leaf.padded_rows - leaf.rows
    return np.pad(array, [(0, pad)] + [(0, 0)] * (array.ndim - 1))


def shard_params(
    params: Any, mesh: Mesh, layout: ParamLayout, *, axis_name: AxisName = "dp"
) -> Any:
    """Place ``params`` as each device's padded dim-0 chunk over ``axis_name``.

    Args:
        params: the tree ``layout`` was made from (host or device arrays).
        mesh: the mesh the training step runs on.
        layout: from ``param_layout``.
        axis_name: the data-parallel axis (or tuple of axes); on the mesh of a hybrid-sharding
            topology ``"dp"`` is cut over ``"dp_shard"`` (``split_axes``).

    Returns:
        A tree of the same structure whose leaves are ``(N * c, *rest)`` arrays in torch's
        layout, sharded ``P(axis_name)`` (replicated over the other mesh axes).

    Example:
        >>> sharded = shard_params(params, mesh, layout)
    """
    axes = check_mesh(layout, mesh, axis_name)
    sharding = NamedSharding(mesh, P(axes))
    out = []
    for leaf, value in zip(layout.leaves, flat_leaves(params, layout, "params"), strict=True):
        host = padded_host(leaf, value, layout.world_size)
        out.append(jax.make_array_from_callback(host.shape, sharding, host.__getitem__))
    return jax.tree_util.tree_unflatten(layout.treedef, out)


def unshard_params(sharded: Any, layout: ParamLayout) -> Any:
    """Whole Flax-layout NumPy arrays from a sharded tree (parameters, or optimizer moments
    shaped like them, ``None`` where a leaf is absent). Needs every shard addressable (one
    process); padding is dropped.

    Example:
        >>> full = unshard_params(sharded, layout)
        >>> mu = unshard_params(opt_state[0].mu, layout)
    """
    out: list[np.ndarray | None] = []
    for leaf, value in zip(layout.leaves, flat_leaves(sharded, layout, "the tree"), strict=True):
        if value is None:
            out.append(None)
            continue
        array = np.asarray(value)[: leaf.rows]
        out.append(np.transpose(array, leaf.inverse_perm))
    return jax.tree_util.tree_unflatten(layout.treedef, out)
