"""Parameters' all-gather forward and their gradients' reduce-scatter backward, in ``shard_map``.

Each parameter's padded chunk is all-gathered along dim 0 (``tiled``: rank-major, so the
result is the padded whole in torch's layout), the padding rows are sliced off and the layout
transposed back to Flax's. The backward is the transpose (ZeRO-3, arXiv:1910.02054 §5.3):
each gradient is transposed to torch's layout, padded and ``psum_scatter``-ed along dim 0,
divided as FSDP2 divides (the core's ``mean_divisors(dtype, n, "fsdp2")``, the rule torch's
``fully_shard`` runs; docs/design.md §7), so each device receives its chunk's mean gradient.
A custom VJP (rather than JAX's own transpose of ``all_gather``) owns that division. The
parameters a gather is asked for are gathered in one custom-VJP call, but with one collective
per parameter rather than FSDP2's flattened buffer per unit: the copies in and
out of that buffer doubled the step's temporary bytes on XLA:CPU and its step time
(benchmarks/jax_fsdp.py, docs/jax-zero3.md), and XLA's collective combiners may merge the
per-parameter ones.

When a gather happens is the caller's (gradsync_jax/param_sharding/order.py): every gather
takes ``after``, values it must wait for, and reads its chunks through them (``_read_after``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradsync_core.plan import mean_divisors
from gradsync_jax._axes import (
    cast_varying,
    dtype_name,
    psum_mean,
    psum_scatter_mean,
    varying,
)
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout
from gradsync_jax.param_sharding.policy import MixedPrecisionPolicy


def _gather(chunks: Sequence[jax.Array], axes: tuple[str, ...]) -> list[jax.Array]:
    return [lax.all_gather(c, axes, tiled=True) for c in chunks]


def reduce_gradient(
    grad: jax.Array, axes: tuple[str, ...], n: int, replicate: tuple[str, ...], mean: bool
) -> jax.Array:
    """This device's chunk of ``grad`` summed over ``axes`` (``n`` devices) and, under HSDP,
    all-reduced over ``replicate``; with ``mean``, divided as FSDP2 divides
    (``mean_divisors(dtype, n * replicas, "fsdp2")``): float32 and bfloat16 average in each
    collective, which JAX, without an averaging collective, divides by the ``"after"`` rule
    (after the sum where that is exact); any other dtype (float16) divides by FSDP2's power
    of two ``pre`` before the sums (exact) and by ``post`` after them, in float32 and rounded
    once, as torch divides a half tensor (XLA turns a division by a constant into a product
    with its rounded reciprocal, which rounds twice)."""
    replicas = lax.axis_size(replicate) if replicate else 1
    rule = mean_divisors(dtype_name(grad.dtype), n * replicas, "fsdp2", shard=n) if mean else None
    if rule is not None and rule.op == "avg":
        out = psum_scatter_mean(grad, axes, n, mean=True)
        return psum_mean(out, replicate, mean=rule.replicate_op == "avg") if replicate else out
    if rule is not None and rule.pre is not None:
        grad = grad / rule.pre
    out = lax.psum_scatter(grad, axes, scatter_dimension=0, tiled=True)
    out = lax.psum(out, replicate) if replicate else out
    if rule is None or rule.post is None:
        return out
    wide = jnp.promote_types(out.dtype, jnp.float32)
    return (out.astype(wide) / rule.post).astype(out.dtype)


def _unpadded(leaf: LeafLayout, padded: jax.Array) -> jax.Array:
    return jnp.transpose(padded[: leaf.rows], leaf.inverse_perm)


def _padded(leaf: LeafLayout, grad: jax.Array, n: int) -> jax.Array:
    torch_layout = jnp.transpose(grad, leaf.perm)
    pad = n * leaf.padded_rows - leaf.rows
    return jnp.pad(torch_layout, [(0, pad)] + [(0, 0)] * (torch_layout.ndim - 1))


def _read_after(chunks: tuple[jax.Array, ...], value: jax.Array) -> tuple[jax.Array, ...]:
    """``chunks`` unchanged, bit for bit, but computed from ``value``, so nothing that reads
    them can start before ``value`` exists.

    An opaque zero (``b·(1−b)`` for ``b = value[0] < 0``, 0 or 1) starts a dynamic slice
    that reads each chunk back out of itself extended by one row. Cheaper orderings do not
    survive XLA:CPU: it removes ``lax.optimization_barrier`` before it schedules, and folds
    the identities it can see (a full-size dynamic slice, ``x & 0``, ``x - x``). The cost is
    a copy of each chunk, ``1/N`` of the parameter.
    """
    first = lax.convert_element_type(jnp.ravel(value)[0], jnp.float32)
    b = (first < 0).astype(jnp.int32)
    zero = b * (1 - b)
    out = []
    for c in chunks:
        extended = jnp.concatenate([c, c[:1]])
        out.append(lax.dynamic_slice(extended, (zero,) + (0,) * (c.ndim - 1), c.shape))
    return tuple(out)


def _members_gather(
    leaves: Sequence[LeafLayout],
    axes: tuple[str, ...],
    n: int,
    mean: bool,
    trainable: bool,
    mp_policy: MixedPrecisionPolicy,
    replicate: tuple[str, ...] = (),
) -> Any:
    """``gather(chunks, after)``: the whole Flax-layout parameters of ``leaves``, all_gather
    forward, reduce-scatter (mean) backward, or zeros and no collective for frozen members;
    the chunks read through ``after[0]`` when there is one (``_read_after``), which gets no
    cotangent."""

    def gathered(chunks: tuple[jax.Array, ...], after: tuple[jax.Array, ...]) -> list[jax.Array]:
        chunks = tuple(mp_policy.gathered(c) for c in chunks)
        # Varying over the replicas, as the batch: otherwise JAX marks it where the model
        # mixes it with the batch, and that mark's transpose sums the cotangents over the
        # replicas before the backward below sees them. The backward owns that reduction.
        chunks = cast_varying(chunks, replicate) if replicate else chunks
        chunks = _read_after(chunks, after[0]) if after else chunks
        whole = _gather(chunks, axes)
        return [_unpadded(leaf, w) for leaf, w in zip(leaves, whole, strict=True)]

    @jax.custom_vjp
    def gather(chunks: tuple[jax.Array, ...], after: tuple[jax.Array, ...]) -> list[jax.Array]:
        return gathered(chunks, after)

    def fwd(chunks: tuple, after: tuple) -> tuple[list[jax.Array], tuple]:
        # Not ``after``: it gets no cotangent (None), and keeping it would hold an
        # activation to the backward.
        return gathered(chunks, after), chunks  # the chunks only for their zeros (frozen)

    def bwd(chunks: tuple, cotangents: list[jax.Array]) -> tuple[Any, Any]:
        if not trainable:
            return tuple(jnp.zeros_like(c) for c in chunks), None
        padded = [
            _padded(leaf, mp_policy.reduced(g), n)
            for leaf, g in zip(leaves, cotangents, strict=True)
        ]
        # HSDP: the shard groups' chunks then all-reduced across the replicas.
        scattered = [reduce_gradient(g, axes, n, replicate, mean) for g in padded]
        return tuple(g.astype(c.dtype) for g, c in zip(scattered, chunks, strict=True)), None

    gather.defvjp(fwd, bwd)
    return gather


class Gatherer:
    """``gatherer(indices, chunks, after)``: the leaves ``indices`` of ``layout`` whole, in
    Flax layout, from this device's ``chunks`` of them, gathered once ``after`` exists.

    One custom-VJP call per kind among them (trainable or frozen, and dtype): an all-gather
    per parameter forward and a reduce-scatter of its gradient backward, or for frozen
    members no gradient and no collective. ``mp_policy`` casts what is gathered and what is
    reduced (mixed precision, FSDP2's policy). With ``replicate`` axes (hybrid sharding, HSDP)
    the reduce-scattered chunks are then all-reduced across them (``reduce_gradient``, FSDP2's
    mean over both): the shard groups hold the same chunks and step them identically.
    """

    def __init__(
        self,
        layout: ParamLayout,
        axes: tuple[str, ...],
        *,
        mean: bool = True,
        mp_policy: MixedPrecisionPolicy | None = None,
        replicate: tuple[str, ...] = (),
    ) -> None:
        self.layout, self.axes, self.mean = layout, axes, mean
        self.mp_policy = MixedPrecisionPolicy() if mp_policy is None else mp_policy
        self.replicate = replicate

    def __call__(
        self, indices: Sequence[int], chunks: Sequence[jax.Array], after: Sequence[jax.Array]
    ) -> list[jax.Array]:
        kinds: dict[tuple[bool, str], list[int]] = {}
        for k, i in enumerate(indices):
            key = (self.layout.leaves[i].trainable, str(chunks[k].dtype))
            kinds.setdefault(key, []).append(k)
        after = self._ordering(chunks[0], after)
        whole: list[Any] = [None] * len(indices)
        for (trainable, _), ks in sorted(kinds.items()):
            call = _members_gather(
                [self.layout.leaves[indices[k]] for k in ks],
                self.axes,
                self.layout.world_size,
                self.mean,
                trainable,
                self.mp_policy,
                self.replicate,
            )
            for k, value in zip(ks, call(tuple(chunks[k] for k in ks), after), strict=True):
                whole[k] = value
        return whole

    def _ordering(self, chunk: jax.Array, after: Sequence[Any]) -> tuple[jax.Array, ...]:
        """The first of ``after`` the chunks can be read through, without a gradient: a
        non-empty real, integer or boolean array (not a PRNG key) no more varying than the
        (cast) chunks, so reading through it changes neither their types nor their
        cotangents. None: the gather is unordered."""
        allowed = varying(chunk) | set(self.replicate)
        for a in after:
            if (
                isinstance(a, jax.Array)
                and a.size
                and any(jnp.issubdtype(a.dtype, t) for t in (jnp.floating, jnp.integer, jnp.bool_))
                and varying(a) <= allowed
            ):
                return (lax.stop_gradient(a),)
        return ()
