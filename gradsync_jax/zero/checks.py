"""What ``shard_optimizer``'s update verifies before it traces anything.

Where it runs, the gradients it gets (LOCAL, floating) and the state (this transformation's,
one row per device).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from gradsync_jax._axes import AxisName, axis_tuple, display_axis, tracks_variance, varying
from gradsync_jax.zero.layout import Layout, ZeroState


def check_inside(axes: tuple[str, ...], n: int) -> bool:
    """Check that the update runs in ``shard_map`` over ``n`` devices; True if JAX tracks
    variance there."""
    try:
        size = lax.axis_size(axes)
    except NameError:
        raise ValueError(
            f"the update of shard_optimizer must run inside jax.shard_map over mesh axis "
            f"{display_axis(axes)!r}, with the optimizer state passed with "
            "in_specs=tx.state_specs(params) (it reduces the local gradients itself)"
        ) from None
    if size != n:
        raise ValueError(
            f"axis {axes} has {size} devices here but the optimizer was built for {n}; "
            "build shard_optimizer with the mesh the step runs on"
        )
    return tracks_variance(axes)


def check_grads(axis_name: AxisName, layout: Layout, grads: list[Any], tracked: bool) -> None:
    for spec, g in zip(layout.space.specs, grads, strict=True):
        if not jnp.issubdtype(g.dtype, jnp.inexact):
            raise TypeError(f"gradient {spec.name!r} has non-floating dtype {g.dtype}")
        if tracked and not set(axis_tuple(axis_name)) <= varying(g):
            raise ValueError(
                f"gradient {spec.name!r} is invariant over {axis_name!r}: it was "
                "already summed (jax.grad of a replicated parameter inside shard_map, or "
                "sync_gradients), and shard_optimizer would sum it again. Pass LOCAL "
                "gradients: differentiate w.r.t. gradsync_jax.make_local(params) (or use "
                "value_and_local_grad) and do not call sync_gradients first"
            )


def check_state(spec_entry: Any, layout: Layout, state: Any) -> None:
    if not isinstance(state, ZeroState):
        raise TypeError(
            f"state must be the ZeroState from this transformation's init, got "
            f"{type(state).__name__}"
        )
    expected = layout.state_specs(spec_entry)
    wanted = len(jax.tree.leaves(expected.inner, is_leaf=lambda x: isinstance(x, P)))
    if len(jax.tree.leaves(state.inner)) != wanted or set(state.shards) != set(expected.shards):
        raise ValueError(
            "the optimizer state does not match this transformation and parameter tree: "
            "pass the state that tx.init(params) returned (and the updates made from it)"
        )
    # flat: 1-D chunks in the inner state; greedy: the global leaves, whole
    for leaf, want in zip(jax.tree.leaves(state.inner), layout.local_shapes(), strict=True):
        if tuple(leaf.shape) != tuple(want):
            raise ValueError(
                f"an optimizer state leaf has local shape {tuple(leaf.shape)}, expected "
                f"{tuple(want)}; pass the state into shard_map with "
                "in_specs=tx.state_specs(params) and the same parameter tree it was "
                "initialized with"
            )
    for dtype, buf in state.shards.items():
        if dtype not in expected.shards or buf.ndim != 2 or buf.shape[0] != 1:
            raise ValueError(
                f"optimizer state buffer {dtype!r} has local shape {buf.shape}; pass the "
                "state into shard_map with in_specs=tx.state_specs(params) (one row per "
                "device) and the same parameter tree it was initialized with"
            )
