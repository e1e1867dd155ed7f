"""A model as the pipeline sees it: an embedding, a stack of equal blocks, a head with the loss.

The stack is how MaxText and Flax scan layers: every parameter of the blocks has a leading
layer dimension (``nnx.vmap`` over a block's constructor, ``nn.scan``/``nn.vmap`` in linen,
or a ``jax.vmap``-ed init). The parameters are one dict ``{"embed": ..., "blocks": ...,
"head": ...}``: in **natural** layout the blocks' leaves are ``(L, ...)``, layer by layer; in
**pipeline** layout every leaf has a leading ``pp`` dimension that the mesh shards, so each
pipeline rank holds only its own stages' blocks: ``blocks`` leaves are ``(pp, v, k, ...)``,
``[r, j]`` the k blocks of rank r's j-th stage, and ``embed``/``head`` one copy per rank
(``(pp, ...)``), kept equal because every rank applies the same update to them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import PipelinePlan

PARTS = ("embed", "blocks", "head")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineModel:
    """The three functions a pipeline runs (``flax_model`` and ``linen_model`` build them).

    Args:
        embed: ``embed(params["embed"], inputs) -> activations``, on the first stage.
        block: ``block(one block's params, activations) -> activations`` of the same shape
            and dtype; stage s runs blocks ``s*k .. s*k + k - 1`` in order.
        head: ``head(params["head"], activations, targets) -> loss``, the mean loss of one
            microbatch, on the last stage.
    """

    embed: Callable[[Any, Any], jax.Array]
    block: Callable[[Any, jax.Array], jax.Array]
    head: Callable[[Any, jax.Array, Any], jax.Array]


def blocks_per_stage(params: Any, plan: PipelinePlan) -> int:
    """The blocks each stage holds: the layer count over the plan's stages.

    Raises:
        ValueError: if ``params`` is not ``{"embed", "blocks", "head"}``, the blocks' leaves
            disagree on the layer count, the stages cannot hold equal shares, or the plan's
            layout gives its stages unequal numbers of layers.
    """
    if not isinstance(params, dict) or set(params) != set(PARTS):
        got = sorted(params) if isinstance(params, dict) else type(params).__name__
        raise ValueError(
            f"pipeline parameters are a dict with keys 'embed', 'blocks' and 'head' (the "
            f"blocks' leaves stacked on a leading layer dimension); got {got}"
        )
    layers = {
        np.shape(leaf)[0] if np.ndim(leaf) else None for leaf in jax.tree.leaves(params["blocks"])
    }
    if len(layers) != 1 or None in layers:
        raise ValueError(
            f"every leaf of params['blocks'] needs the same leading layer dimension, got "
            f"{sorted(layers, key=str)}; stack the blocks (nnx.vmap, nn.scan or jax.vmap)"
        )
    (count,) = layers
    n = plan.num_stages
    if count % n:
        raise ValueError(
            f"{count} blocks do not split evenly over the plan's {n} stages; every stage runs "
            "the same program, so give a multiple of the stage count"
        )
    k = count // n
    counts = [s.layout.count("t") for s in plan.stages]
    if any(s.layout for s in plan.stages) and (set(counts) != {k} or "m" in plan.layout):
        raise ValueError(
            f"the plan's layout {plan.layout!r} gives its stages {counts} blocks, but every "
            f"stage must run {k} of the {count} blocks (one SPMD program); plan it with "
            f"layers={count}, input_weight=0, output_weight=0 or a layout of {k} 't' per stage"
        )
    return k


def stage_order(plan: PipelinePlan) -> list[int]:
    """The stages in pipeline layout order: rank by rank, each rank's stages in order."""
    return [stage.index for rank in range(plan.pp) for stage in plan.stages_of(rank)]


def pipeline_params(params: Any, plan: PipelinePlan, mesh: Mesh | None = None) -> Any:
    """Natural layout (blocks ``(L, ...)``) to pipeline layout (every leaf ``(pp, ...)``).

    The arrays are rearranged on the host (NumPy); with ``mesh`` they are placed sharded
    over its ``pp`` axis, so each device receives only its own stages.

    Raises:
        ValueError: as ``blocks_per_stage``.

    Example:
        >>> p = pipeline_params({"embed": e, "blocks": b, "head": h}, plan, mesh)
        >>> natural_params(p, plan)["blocks"]["w"].shape == b["w"].shape
        True
    """
    k = blocks_per_stage(params, plan)
    pp, v, order = plan.pp, plan.stages_per_rank, np.asarray(stage_order(plan))

    def blocks(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        by_stage = leaf.reshape(plan.num_stages, k, *leaf.shape[1:])
        return by_stage[order].reshape(pp, v, k, *leaf.shape[1:])

    def copies(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        return np.broadcast_to(leaf, (pp, *leaf.shape)).copy()

    out = {
        "embed": jax.tree.map(copies, params["embed"]),
        "blocks": jax.tree.map(blocks, params["blocks"]),
        "head": jax.tree.map(copies, params["head"]),
    }
    if mesh is None:
        return out
    return jax.device_put(out, NamedSharding(mesh, P("pp")))


def natural_params(params: Any, plan: PipelinePlan) -> Any:
    """Pipeline layout back to natural layout, as NumPy arrays (pipeline rank 0's copy of
    the embedding and head: every rank's is the same)."""
    inverse = np.argsort(stage_order(plan))

    def blocks(leaf: Any) -> np.ndarray:
        leaf = np.asarray(leaf)
        by_stage = leaf.reshape(plan.num_stages, *leaf.shape[2:])[inverse]
        return by_stage.reshape(plan.num_stages * leaf.shape[2], *leaf.shape[3:])

    return {
        "embed": jax.tree.map(lambda leaf: np.asarray(leaf)[0], params["embed"]),
        "blocks": jax.tree.map(blocks, params["blocks"]),
        "head": jax.tree.map(lambda leaf: np.asarray(leaf)[0], params["head"]),
    }
