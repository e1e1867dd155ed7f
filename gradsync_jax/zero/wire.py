"""How a flat layout's buckets travel: the small ones share one collective.

Which buckets share one collective, and the packed reduce-scatter and all-gather that carry
them (docs/jax-zero.md, "Against the JAX-native way").

What a device stores is the layout's business (``flat.FlatLayout``: range ``i`` of every
bucket on device ``i``); this module only decides how many collectives carry the buckets.
Each collective is one rendezvous of every device, whatever its size, and a model has as many
biases and norms as weight matrices: with one bucket per parameter (flat by parameter) the
small ones would cost as many collectives as the large ones. So buckets below
``PACK_BELOW_BYTES`` (same dtype, in plan order) share one reduce-scatter and one all-gather,
up to ``PACK_CAP_BYTES`` a group, laid out device-major (row ``d``: chunk ``d`` of each
member), so the packed reduce-scatter still leaves device ``d`` its own chunk of every member.
Measured: a collectives-only step of 10 x 1000² with biases took 0.71-0.83x the time with the
ten biases packed, and auto's AdamW step went from 1.09x to 0.90x the ``jit`` +
``NamedSharding`` way (8 CPU devices, quiet 2-core machine).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

from gradsync_jax._axes import psum_scatter_mean
from gradsync_jax.zero.model_space import itemsize

PACK_BELOW_BYTES = 256 * 1024
PACK_CAP_BYTES = 4 * 1024 * 1024

Groups = tuple[tuple[int, ...], ...]


def wire_groups(buckets: Sequence[Any], pack: bool) -> Groups:
    """The buckets (each with ``numel`` and ``dtype``) that travel in one collective: each
    alone, except, when ``pack``, the small ones packed together as the module says."""
    groups: list[list[int]] = []
    open_group: dict[str, list[int]] = {}
    for b, bucket in enumerate(buckets):
        nbytes = bucket.numel * itemsize(bucket.dtype)
        if not pack or nbytes >= PACK_BELOW_BYTES:
            groups.append([b])
            continue
        members = open_group.get(bucket.dtype)
        size = sum(buckets[m].numel for m in members or [])
        if members is None or (size * itemsize(bucket.dtype) + nbytes) > PACK_CAP_BYTES:
            members = open_group[bucket.dtype] = []
            groups.append(members)
        members.append(b)
    return tuple(tuple(g) for g in groups)


def reduce_scatter(
    flats: Sequence[Any], groups: Groups, axes: tuple[str, ...], n: int, mean: bool
) -> list[Any]:
    """This device's chunk of every padded flat bucket in ``flats``, summed (or averaged) over
    ``axes``: one reduce-scatter per group, a packed group laid out device-major first."""
    out: list[Any] = [None] * len(flats)
    for group in groups:
        if len(group) == 1:
            out[group[0]] = psum_scatter_mean(flats[group[0]], axes, n, mean=mean)
            continue
        rows = jnp.concatenate([flats[b].reshape(n, -1) for b in group], axis=1)
        mine = psum_scatter_mean(rows.reshape(-1), axes, n, mean=mean)
        cuts = np.cumsum([flats[b].size // n for b in group])[:-1]
        for b, part in zip(group, jnp.split(mine, cuts), strict=True):
            out[b] = part
    return out


def all_gather(chunks: Sequence[Any], groups: Groups, axes: tuple[str, ...], n: int) -> list[Any]:
    """Every bucket whole (replicated) from each device's chunk: one all-gather per group."""
    out: list[Any] = [None] * len(chunks)
    for group in groups:
        if len(group) == 1:
            out[group[0]] = lax.all_gather(chunks[group[0]], axes, tiled=True, to="invarying")
            continue
        mine = jnp.concatenate([chunks[b] for b in group])
        rows = lax.all_gather(mine, axes, tiled=True, to="invarying").reshape(n, -1)
        cuts = np.cumsum([chunks[b].size for b in group])[:-1]
        for b, cols in zip(group, jnp.split(rows, cuts, axis=1), strict=True):
            out[b] = cols.reshape(-1)
    return out
