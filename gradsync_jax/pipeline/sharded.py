"""ZeRO-3 on the pipeline: what each pipeline rank holds, cut over the data-parallel axis.

A ``zero3`` plan (``plan_pipeline(..., zero3=True)``) shards every stage's parameters as
``zero3_step`` shards a model (docs/jax-zero3.md): a leaf is cut on dim 0 of torch's layout of
ONE layer and zero padded (FSDP2's cut, ``chunk_rows``), and each device of a data-parallel
group keeps its chunk of every layer of its rank's stages and of its rank's copies of the
embedding and head. ``pipeline_layout`` (layout.py) is ``param_layout`` of that unit,
``{"embed", one block, "head"}``; a sharded leaf is the pipeline layout's with each layer in
torch's layout, padded: ``(pp, n * c, *rest)`` for the embedding and head, ``(pp, v, k,
n * c, *rest)`` for the blocks, split over ``pp`` and the data-parallel axis.

The step gathers its rank's stages before the tick loop (the plan's ``UNSHARD`` before a
stage's first forward), runs the loop on the whole parameters and reduce-scatters the summed
gradients after it (``RESHARD`` and ``REDUCE_GRAD`` after a stage's last weight gradient), as
torch's executor does with ``fully_shard``-ed stages (their gradients accumulate unsharded
and are reduced in the last backward). The all-gather and the reduce-scatter (its division
FSDP2's, HSDP's all-reduce across the replicas) are ``zero3_step``'s: ``Gatherer``, vmapped
over a stage's stacked blocks, its custom VJP pulled back on the gradient sums. The optimizer
steps on the chunks, so its state is 1/n too.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from gradsync_jax.param_sharding.gather import Gatherer
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout
from gradsync_jax.param_sharding.placement import padded_host
from gradsync_jax.pipeline.model import PARTS

# The leading dimensions of a pipeline-layout leaf before the layer's own: (pp,) or (pp, v, k).
LEAD = {"embed": 1, "blocks": 3, "head": 1}


def layout_tree(layout: ParamLayout) -> Any:
    """``{"embed", "blocks", "head"}`` with each leaf's ``LeafLayout`` in its place."""
    return jax.tree_util.tree_unflatten(layout.treedef, list(layout.leaves))


def _is_leaf_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def _each_layer(value: Any, lead: int, fn: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """``fn`` of every layer of ``value`` (its first ``lead`` dimensions index the layers)."""
    array = np.asarray(value)
    shape = array.shape[:lead]
    out = [fn(array[index]) for index in np.ndindex(*shape)]
    return np.stack(out).reshape(*shape, *out[0].shape)


def shard_leaf(value: Any, leaf: LeafLayout, n: int) -> np.ndarray:
    """A pipeline-layout host leaf (or a state leaf shaped like it) to its sharded form:
    every layer in torch's layout, dim 0 padded to ``n`` chunks."""
    lead = np.ndim(value) - len(leaf.shape)
    return _each_layer(value, lead, lambda layer: padded_host(leaf, layer, n))


def unshard_leaf(value: Any, leaf: LeafLayout) -> np.ndarray:
    """``shard_leaf``'s inverse: the padding dropped, every layer in Flax's layout."""
    lead = np.ndim(value) - len(leaf.torch_shape)
    return _each_layer(
        value, lead, lambda layer: np.transpose(layer[: leaf.rows], leaf.inverse_perm)
    )


def shard_tree(tree: Any, layout: ParamLayout, n: int) -> Any:
    """``shard_leaf`` of every leaf of a pipeline-layout tree ``{"embed", "blocks", "head"}``."""
    return jax.tree.map(lambda x, leaf: shard_leaf(x, leaf, n), tree, layout_tree(layout))


def unshard_tree(tree: Any, layout: ParamLayout) -> Any:
    """``unshard_leaf`` of every leaf of a sharded tree."""
    return jax.tree.map(unshard_leaf, tree, layout_tree(layout))


def sharded_specs(params: Any, axes: tuple[str, ...]) -> Any:
    """The ``PartitionSpec`` of every sharded leaf: ``pp`` first, the chunks' rows over
    ``axes``."""

    rows = axes[0] if len(axes) == 1 else axes

    def spec(part: str) -> P:
        return P("pp", *([None] * (LEAD[part] - 1)), rows)

    return {part: jax.tree.map(lambda _, part=part: spec(part), params[part]) for part in PARTS}


def check_sharded(params: Any, layout: ParamLayout, pp: int, v: int) -> None:
    """Refuse parameters that are not the sharded pipeline layout of ``layout``.

    Raises:
        ValueError: naming the leaf, its shape and the one expected.
    """
    n = layout.world_size
    count = len(jax.tree.leaves(params))
    if count != len(layout.leaves):
        raise ValueError(
            f"the parameters have {count} leaves but the layout {len(layout.leaves)}; "
            "pass the tree pipeline_layout was made from"
        )
    for part in PARTS:
        lead = (pp,) if LEAD[part] == 1 else (pp, v)
        for value, leaf in zip(
            jax.tree.leaves(params[part]),
            jax.tree.leaves(layout_tree(layout)[part], is_leaf=_is_leaf_layout),
            strict=True,
        ):
            shape = tuple(np.shape(value))
            rest = (n * leaf.padded_rows, *leaf.torch_shape[1:])
            if shape[: len(lead)] != lead or shape[LEAD[part] :] != rest:
                raise ValueError(
                    f"{leaf.flax_name!r} has shape {shape}, not the sharded pipeline layout's "
                    f"{(*lead, 'k') if part == 'blocks' else lead} + {rest}; place natural "
                    "parameters with pipeline_params(params, plan, mesh, layout=layout)"
                )


class StageGather:
    """``gather(chunks) -> whole``: one device's ``(embed, blocks, head)`` chunks (the
    blocks' ``(v, k, c, ...)``) all-gathered to the whole parameters in Flax's layout, inside
    ``shard_map``; ``jax.vjp`` of it reduce-scatters gradients to the chunks (``Gatherer``,
    its mean FSDP2's over the shard and replicate axes)."""

    def __init__(
        self, layout: ParamLayout, axes: tuple[str, ...], replicate: tuple[str, ...]
    ) -> None:
        self.layout = layout
        self.gatherer = Gatherer(layout, axes, replicate=replicate)
        tree = layout_tree(layout)
        parts = jax.tree.leaves({p: jax.tree.map(lambda _, p=p: p, tree[p]) for p in PARTS})
        self.blocks = [i for i, part in enumerate(parts) if part == "blocks"]
        self.others = [i for i, part in enumerate(parts) if part != "blocks"]

    def __call__(self, chunks: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
        tree = dict(zip(PARTS, chunks, strict=True))
        flat = jax.tree_util.tree_leaves(tree)
        whole: list[Any] = [None] * len(flat)
        if self.others:
            got = self.gatherer(self.others, [flat[i] for i in self.others], ())
            for i, value in zip(self.others, got, strict=True):
                whole[i] = value
        if self.blocks:

            def one_layer(*layer: Any) -> list[Any]:
                return self.gatherer(self.blocks, list(layer), ())

            got = jax.vmap(jax.vmap(one_layer))(*(flat[i] for i in self.blocks))
            for i, value in zip(self.blocks, got, strict=True):
                whole[i] = value
        out = jax.tree_util.tree_unflatten(jax.tree.structure(tree), whole)
        return tuple(out[part] for part in PARTS)
