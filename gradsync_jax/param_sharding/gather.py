"""A unit's all-gather forward and its gradients' reduce-scatter backward, inside ``shard_map``.

Each parameter's padded chunk is all-gathered along dim 0 (``tiled``: rank-major, so the
result is the padded whole in torch's layout), the padding rows are sliced off and the layout
transposed back to Flax's. The backward is the transpose (ZeRO-3, arXiv:1910.02054 §5.3):
each gradient is transposed to torch's layout, padded and ``psum_scatter``-ed along dim 0,
divided where ``divide_after`` says (docs/design.md §7), so each device receives its chunk's
mean gradient. A custom VJP (rather than JAX's own transpose of ``all_gather``) owns that
division. A unit's members are gathered together (one custom-VJP call), but one collective
per parameter rather than FSDP2's flattened buffer per unit: the copies in and out of that
buffer doubled the step's temporary bytes on XLA:CPU and its step time
(benchmarks/jax_fsdp.py, docs/jax-zero3.md), and XLA's collective combiners may merge the
per-parameter ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.ad_checkpoint import checkpoint_name

from gradsync_jax._axes import cast_varying, psum_mean, psum_scatter_mean
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout

# The name of every gathered parameter: rematerialized, not saved, with reshard_after_forward.
GATHERED = "gradsync_gathered_param"


def _gather(chunks: Sequence[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    return [lax.all_gather(c, axes, tiled=True) for c in chunks]


def _scatter(
    grads: Sequence[jax.Array], axes: tuple[str, ...], n: int, mean: bool
) -> tuple[jax.Array, ...]:
    return tuple(psum_scatter_mean(g, axes, n, mean=mean) for g in grads)


def _unpadded(leaf: LeafLayout, padded: jax.Array) -> jax.Array:
    return jnp.transpose(padded[: leaf.rows], leaf.inverse_perm)


def _padded(leaf: LeafLayout, grad: jax.Array, n: int) -> jax.Array:
    torch_layout = jnp.transpose(grad, leaf.perm)
    pad = n * leaf.padded_rows - leaf.rows
    return jnp.pad(torch_layout, [(0, pad)] + [(0, 0)] * (torch_layout.ndim - 1))


@dataclass(frozen=True, slots=True)
class Precision:
    """FSDP2's ``MixedPrecisionPolicy`` for the gather: ``param_dtype`` is what the chunks are
    cast to before the all-gather (what the model computes with), ``reduce_dtype`` what the
    gradients are cast to before the reduce-scatter; ``None`` keeps the stored dtype, and a
    ``None`` ``reduce_dtype`` follows ``param_dtype``, as FSDP2's does. The reduced chunk
    gradient is cast back to the stored (master) dtype for the optimizer."""

    param_dtype: Any = None
    reduce_dtype: Any = None

    def gathered(self, chunk: jax.Array) -> jax.Array:
        return chunk if self.param_dtype is None else chunk.astype(self.param_dtype)

    def reduced(self, grad: jax.Array) -> jax.Array:
        dtype = self.param_dtype if self.reduce_dtype is None else self.reduce_dtype
        return grad if dtype is None else grad.astype(dtype)


def _unit_gather(
    leaves: Sequence[LeafLayout],
    axes: tuple[str, ...],
    n: int,
    mean: bool,
    trainable: bool,
    precision: Precision,
    replicate: tuple[str, ...] = (),
) -> Any:
    """The whole Flax-layout parameters of one group of chunks: all_gather forward,
    reduce-scatter (mean) backward, or zeros and no collective for frozen members.

    One custom-VJP call from chunks to what the model reads, so a remat policy that refuses to
    save its outputs leaves only the chunks as residuals: the backward gathers again.
    """

    def gathered(*chunks: jax.Array) -> list[jax.Array]:
        whole = _gather([precision.gathered(c) for c in chunks], axes)
        # Varying over the replicas, as the batch: otherwise JAX marks it where the model
        # mixes it with the batch, and that mark's transpose sums the cotangents over the
        # replicas before the backward below sees them. The backward owns that reduction.
        whole = cast_varying(whole, replicate) if replicate else whole
        return [_unpadded(leaf, w) for leaf, w in zip(leaves, whole, strict=True)]

    @jax.custom_vjp
    def gather(*chunks: jax.Array) -> list[jax.Array]:
        return gathered(*chunks)

    def fwd(*chunks: jax.Array) -> tuple[list[jax.Array], tuple[jax.Array, ...]]:
        return gathered(*chunks), chunks  # the chunks only for their zeros (frozen)

    def bwd(chunks: tuple[jax.Array, ...], cotangents: list[jax.Array]) -> tuple[Any, ...]:
        if not trainable:
            return tuple(jnp.zeros_like(c) for c in chunks)
        padded = [
            _padded(leaf, precision.reduced(g), n)
            for leaf, g in zip(leaves, cotangents, strict=True)
        ]
        scattered = _scatter(padded, axes, n, mean)
        if replicate:  # HSDP: the shard groups' chunks all-reduced across the replicas
            scattered = tuple(psum_mean(g, replicate, mean=mean) for g in scattered)
        return tuple(g.astype(c.dtype) for g, c in zip(scattered, chunks, strict=True))

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
    precision: Precision = Precision(),
    replicate: tuple[str, ...] = (),
) -> list[jax.Array]:
    """Every parameter whole, in Flax layout, from this device's chunks (one per leaf).

    One custom-VJP call per unit and dtype for the trainable members (an all-gather per
    parameter; their gradients come back reduce-scattered) and one for the frozen members (no
    gradient, no collective in the backward). Each gathered array is named ``GATHERED`` so a
    ``jax.checkpoint`` policy can drop it after the forward. ``precision`` casts what is
    gathered and what is reduced (mixed precision, FSDP2's policy). With ``replicate`` axes
    (hybrid sharding, HSDP) the reduce-scattered chunks are then all-reduced (mean) across
    them: the shard groups hold the same chunks and step them identically.
    """
    n = layout.world_size
    groups: dict[tuple[int, bool, str], list[int]] = {}
    for i, leaf in enumerate(layout.leaves):
        groups.setdefault((leaf.unit, leaf.trainable, str(chunks[i].dtype)), []).append(i)
    whole: list[Any] = [None] * len(chunks)
    for key in sorted(groups):  # units in the plan's order: root first, then module order
        members = groups[key]
        leaves = [layout.leaves[i] for i in members]
        gather = _unit_gather(
            leaves, axes, n, mean, trainable=key[1], precision=precision, replicate=replicate
        )
        for i, value in zip(members, gather(*(chunks[i] for i in members)), strict=True):
            whole[i] = checkpoint_name(value, GATHERED)
    return whole
