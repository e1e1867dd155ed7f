"""A unit's all-gather forward and its gradients' reduce-scatter backward, inside ``shard_map``.

Like FSDP2's ``foreach_all_gather``, a unit's chunks travel in ONE collective: this device's
padded chunks are flattened back to back into one buffer, all-gathered (rank-major), and cut
into each parameter's ``(N * c, *rest)`` padded whole; the padding rows are sliced off and the
torch layout transposed back to Flax's by ordinary, differentiable ops. The backward is the
transpose (ZeRO-3, arXiv:1910.02054 §5.3): the padded gradients of the unit, back to back per
destination rank, one ``psum_scatter`` (a reduce-scatter), divided where
``divide_after`` says (docs/design.md §7), so each device receives its chunks' mean gradient.
A custom VJP (rather than JAX's own transpose of ``all_gather``) owns that division.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from gradsync_jax._axes import psum_scatter_mean
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout

# The name of every gathered parameter: rematerialized, not saved, with reshard_after_forward.
GATHERED = "gradsync_gathered_param"


def _gather_flat(chunks: Sequence[jax.Array], axes: tuple[str, ...], n: int) -> list[jax.Array]:
    sizes = [math.prod(c.shape) for c in chunks]
    buf = jnp.concatenate([c.reshape(-1) for c in chunks]) if len(chunks) > 1 else chunks[0]
    whole = lax.all_gather(buf.reshape(-1), axes, tiled=True).reshape(n, sum(sizes))
    out, start = [], 0
    for chunk, size in zip(chunks, sizes, strict=True):
        piece = whole[:, start : start + size]
        out.append(piece.reshape(n * chunk.shape[0], *chunk.shape[1:]))
        start += size
    return out


def _scatter_flat(
    grads: Sequence[jax.Array], axes: tuple[str, ...], n: int, mean: bool
) -> tuple[jax.Array, ...]:
    per_rank = [g.reshape(n, -1) for g in grads]  # row block r of each gradient -> rank r
    buf = jnp.concatenate(per_rank, axis=1) if len(grads) > 1 else per_rank[0]
    mine = psum_scatter_mean(buf.reshape(-1), axes, n, mean=mean)
    out, start = [], 0
    for g, rank_part in zip(grads, per_rank, strict=True):
        size = rank_part.shape[1]
        out.append(mine[start : start + size].reshape(g.shape[0] // n, *g.shape[1:]))
        start += size
    return tuple(out)


def _unpadded(leaf: LeafLayout, padded: jax.Array) -> jax.Array:
    return jnp.transpose(padded[: leaf.rows], leaf.inverse_perm)


def _padded(leaf: LeafLayout, grad: jax.Array, n: int) -> jax.Array:
    torch_layout = jnp.transpose(grad, leaf.perm)
    pad = n * leaf.padded_rows - leaf.rows
    return jnp.pad(torch_layout, [(0, pad)] + [(0, 0)] * (torch_layout.ndim - 1))


def _unit_gather(
    leaves: Sequence[LeafLayout], axes: tuple[str, ...], n: int, mean: bool, trainable: bool
) -> Any:
    """The whole Flax-layout parameters of one group of chunks: all_gather forward,
    reduce-scatter (mean) backward, or zeros and no collective for frozen members.

    One custom-VJP call from chunks to what the model reads, so a remat policy that refuses to
    save its outputs leaves only the chunks as residuals: the backward gathers again.
    """

    def gathered(*chunks: jax.Array) -> list[jax.Array]:
        whole = _gather_flat(chunks, axes, n)
        return [_unpadded(leaf, w) for leaf, w in zip(leaves, whole, strict=True)]

    @jax.custom_vjp
    def gather(*chunks: jax.Array) -> list[jax.Array]:
        return gathered(*chunks)

    def fwd(*chunks: jax.Array) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        return gathered(*chunks), chunks  # the chunks only for their zeros (frozen)

    def bwd(chunks: tuple[jax.Array, ...], cotangents: list[jax.Array]) -> tuple[Any, ...]:
        if not trainable:
            return tuple(jnp.zeros_like(c) for c in chunks)
        padded = [_padded(leaf, g, n) for leaf, g in zip(leaves, cotangents, strict=True)]
        return _scatter_flat(padded, axes, n, mean)

    gather.defvjp(fwd, bwd)
    return gather


# What a gathered parameter passes through between its chunks and the model: the all-gather
# and layout-only ops. None of their outputs is saved with reshard_after_forward, so the only
# residual left on that path is the chunk itself and the backward gathers again.
_RECOMPUTED = frozenset(
    {"all_gather", "reshape", "slice", "transpose", "concatenate", "squeeze", "expand_dims"}
)


def remat_policy(prim: Any, *_: Any, **params: Any) -> bool:
    """``jax.checkpoint`` policy of ``reshard_after_forward``: save every value the backward
    needs except gathered parameters, so each unit is all-gathered again for its backward, as
    FSDP2 does (arXiv:1910.02054 §5.3, parameters are "discarded" after use).

    JAX decides residuals per primitive, and differentiation inlines the gather's custom VJP,
    so the policy refuses the primitives a gather is made of (``_RECOMPUTED``) rather than only
    the ``GATHERED`` names: otherwise the value just before a name is saved in its place. The
    model's own reshapes, slices and transposes are then recomputed from their saved inputs
    too, which costs a layout op in the backward, not memory.
    """
    if prim.name == "name":
        return params.get("name") != GATHERED
    return prim.name not in _RECOMPUTED and not prim.name.startswith("custom_vjp_call")


def gather_params(
    chunks: Sequence[jax.Array | None],
    layout: ParamLayout,
    axes: tuple[str, ...],
    *,
    mean: bool = True,
) -> list[jax.Array]:
    """Every parameter whole, in Flax layout, from this device's chunks (one per leaf).

    One all-gather per unit and dtype for the trainable members (their gradients come back
    reduce-scattered) and one for the frozen members (no gradient). Each gathered array is
    named ``GATHERED`` so a ``jax.checkpoint`` policy can drop it after the forward.
    """
    n = layout.world_size
    groups: dict[tuple[int, bool, str], list[int]] = {}
    for i, leaf in enumerate(layout.leaves):
        groups.setdefault((leaf.unit, leaf.trainable, str(chunks[i].dtype)), []).append(i)
    whole: list[Any] = [None] * len(chunks)
    for key in sorted(groups):  # units in the plan's order: root first, then module order
        members = groups[key]
        leaves = [layout.leaves[i] for i in members]
        gather = _unit_gather(leaves, axes, n, mean, trainable=key[1])
        for i, value in zip(members, gather(*(chunks[i] for i in members)), strict=True):
            whole[i] = checkpoint_name(value, GATHERED)
    return whole
