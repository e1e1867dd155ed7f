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


def _trainable_gather(axes: tuple[str, ...], n: int, mean: bool) -> Any:
    """all_gather forward, reduce-scatter (mean) backward, for one group of chunks."""

    @jax.custom_vjp
    def gather(*chunks: jax.Array) -> list[jax.Array]:
        return _gather_flat(chunks, axes, n)

    def fwd(*chunks: jax.Array) -> tuple[list[jax.Array], None]:
        return _gather_flat(chunks, axes, n), None  # the backward needs no residual

    def bwd(_: None, cotangents: list[jax.Array]) -> tuple[jax.Array, ...]:
        return _scatter_flat(cotangents, axes, n, mean)

    gather.defvjp(fwd, bwd)
    return gather


def _unpadded(leaf: LeafLayout, padded: jax.Array) -> jax.Array:
    return jnp.transpose(padded[: leaf.rows], leaf.inverse_perm)


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
        local = [chunks[i] for i in members]
        if key[1]:
            gathered = _trainable_gather(axes, n, mean)(*local)
        else:
            gathered = _gather_flat([lax.stop_gradient(c) for c in local], axes, n)
        for i, padded in zip(members, gathered, strict=True):
            whole[i] = _unpadded(layout.leaves[i], checkpoint_name(padded, GATHERED))
    return whole
