"""Where the parameters and the optimizer state live on the pipeline (docs/pipeline.md).

The parameters are ``{"embed": ..., "blocks": ..., "head": ...}``. In **natural** layout the
blocks' leaves are ``(L, ...)``, layer by layer (a scanned Flax model's). In **pipeline**
layout every leaf has a leading ``pp`` dimension that the mesh shards, so each pipeline rank
holds only its own stages' blocks: ``blocks`` leaves are ``(pp, v, k, ...)``, ``[r, j]`` the k
blocks of rank r's j-th stage; ``embed`` and ``head`` hold one copy per rank (``(pp, ...)``),
kept equal because every rank applies the same update to them (their gradients are summed
over the pipeline first). The optimizer state is each rank's ``tx.init`` of its own
parameters (leaves ``(1, ...)``), stacked on a leading ``pp`` dimension; ``natural_state``
and ``pipeline_state`` convert it from and to the state ``tx.init`` gives the natural
parameters, so a checkpoint continues on any pp.

The **sequential** layout names the model as torch's pipeline sees it, the chain of modules
``nn.Sequential(embedding, *blocks, head)`` that ``gradsync_torch.split_model`` cuts:
``{"0": embed, "1": block 0, ..., "L": block L - 1, "L + 1": head}``, one entry per layer
(``sequential_params``; ``stacked_params`` is its inverse). Through the naming rules of
``gradsync_jax._naming`` its leaves have the torch model's names and layouts
(``1.qkv.kernel`` is ``1.qkv.weight``, transposed): this is the one place where the stacked
blocks meet torch's per-layer names, and what pipeline checkpoints store.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import PipelinePlan
from gradsync_jax.param_sharding.layout import ParamLayout, param_layout
from gradsync_jax.param_sharding.placement import check_mesh
from gradsync_jax.pipeline.model import PARTS
from gradsync_jax.pipeline.sharded import shard_tree, sharded_specs, unshard_tree


def blocks_per_stage(params: Any, plan: PipelinePlan) -> int:
    """The blocks each stage holds: the layer count over the plan's stages.

    Raises:
        ValueError: if ``params`` is not ``{"embed", "blocks", "head"}``, the blocks' leaves
            disagree on the layer count, the stages cannot hold equal shares, or the plan's
            layout gives its stages unequal numbers of layers.
    """
    count = _layers(params)
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


def _to_pipeline(leaf: Any, part: str, plan: PipelinePlan, k: int) -> np.ndarray:
    leaf = np.asarray(leaf)
    if part != "blocks":
        return np.broadcast_to(leaf, (plan.pp, *leaf.shape)).copy()
    by_stage = leaf.reshape(plan.num_stages, k, *leaf.shape[1:])[np.asarray(stage_order(plan))]
    return by_stage.reshape(plan.pp, plan.stages_per_rank, k, *leaf.shape[1:])


def _to_natural(leaf: Any, part: str, plan: PipelinePlan) -> np.ndarray:
    leaf = np.asarray(leaf)
    if part != "blocks":
        return leaf[0]
    by_stage = leaf.reshape(plan.num_stages, *leaf.shape[2:])[np.argsort(stage_order(plan))]
    return by_stage.reshape(plan.num_stages * leaf.shape[2], *leaf.shape[3:])


def sequential_params(params: Any) -> dict[str, Any]:
    """Natural layout (blocks stacked ``(L, ...)``) to the sequential layout: ``{"0": embed,
    "1": block 0, ..., str(L): block L - 1, str(L + 1): head}`` (module docstring), torch's
    names for ``nn.Sequential(embedding, *blocks, head)`` once ``to_torch_state`` renames
    the leaves. Array leaves become NumPy; ``jax.ShapeDtypeStruct`` leaves stay abstract.

    Raises:
        ValueError: as ``blocks_per_stage`` for a tree that is not ``{"embed", "blocks",
            "head"}`` with blocks stacked on one leading layer dimension.

    Example:
        >>> names = to_torch_state(sequential_params(natural))  # '0.token.weight', ...
    """
    layers = _layers(params)
    out = {"0": jax.tree.map(_host, params["embed"])}
    for i in range(layers):
        out[str(i + 1)] = jax.tree.map(lambda leaf, i=i: _host(leaf, i), params["blocks"])
    out[str(layers + 1)] = jax.tree.map(_host, params["head"])
    return out


def stacked_params(sequential: Any) -> dict[str, Any]:
    """``sequential_params``' inverse: ``{"embed", "blocks", "head"}`` with the blocks
    stacked on a leading layer dimension (NumPy, or ``jax.ShapeDtypeStruct``).

    Raises:
        ValueError: if the keys are not ``"0"`` .. ``str(L + 1)`` for some L >= 1, or the
            blocks differ in structure, shape or dtype.
    """
    keys = sorted(sequential, key=lambda k: int(k) if str(k).isdigit() else -1)
    if len(keys) < 3 or keys != [str(i) for i in range(len(keys))]:
        raise ValueError(
            f"a sequential model is keyed '0' (the embedding), '1' .. 'L' (the blocks) and "
            f"'L + 1' (the head); got keys {sorted(sequential)[:5]}"
        )
    blocks = [sequential[k] for k in keys[1:-1]]
    shapes = {
        str(jax.tree.structure(b))
        + str([(np.shape(x), np.dtype(x.dtype)) for x in jax.tree.leaves(b)])
        for b in blocks
    }
    if len(shapes) != 1:
        raise ValueError(
            "the blocks of a sequential model differ in structure, shape or dtype; the "
            "pipeline stacks them, so every block must be the same module"
        )
    return {
        "embed": jax.tree.map(_host, sequential[keys[0]]),
        "blocks": jax.tree.map(_stack, *blocks),
        "head": jax.tree.map(_host, sequential[keys[-1]]),
    }


def _layers(params: Any) -> int:
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
    assert count is not None  # refused above
    return count


def _host(leaf: Any, layer: int | None = None) -> Any:
    """``leaf`` (or its ``layer``-th row) as NumPy; a ``ShapeDtypeStruct`` stays abstract."""
    if isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf if layer is None else jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype)
    leaf = np.asarray(leaf)
    return leaf if layer is None else leaf[layer]


def _stack(*leaves: Any) -> Any:
    if isinstance(leaves[0], jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(leaves), *leaves[0].shape), leaves[0].dtype)
    return np.stack([np.asarray(leaf) for leaf in leaves])


def _parts(params: Any) -> dict[str, Any]:
    """A tree shaped like ``params`` whose leaves name their part."""
    return {part: jax.tree.map(lambda _, part=part: part, params[part]) for part in PARTS}


def pipeline_specs(params: Any, specs: Any = None) -> Any:
    """The ``PartitionSpec`` of every pipeline-layout leaf: ``pp`` first, then ``specs``.

    Args:
        params: a parameter tree ``{"embed", "blocks", "head"}`` (any layout: its structure).
        specs: model parallelism: the same tree of ``PartitionSpec``; a block's spec is one
            layer's (``nnx_model``'s or ``nnx_functional``'s of the stack, without the layer
            dimension). Default: nothing sharded but the pipeline.
    """

    def spec_of(part: str, spec: P) -> P:
        return P("pp", None, None, *spec) if part == "blocks" else P("pp", *spec)

    if specs is None:
        specs = jax.tree.map(lambda _: P(), params)
    return {
        part: jax.tree.map(lambda s, part=part: spec_of(part, s), specs[part], is_leaf=_is_spec)
        for part in PARTS
    }


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def pipeline_layout(params: Any, plan: PipelinePlan) -> ParamLayout:
    """The cut of a ``zero3`` plan's parameters: ``param_layout`` of one pipeline rank's unit
    ``{"embed", one block, "head"}`` over the plan's data-parallel devices (under HSDP cut
    over ``dp_shard`` of them, replicated across the rest).

    Args:
        params: the natural-layout parameters (blocks stacked ``(L, ...)``), arrays or
            ``jax.ShapeDtypeStruct``.
        plan: the pipeline plan.

    Returns:
        The ``ParamLayout``, its leaves in the order of the parameters' leaves.

    Raises:
        ValueError: as ``blocks_per_stage``, or what ``param_layout`` refuses.

    Example:
        >>> layout = pipeline_layout(natural, plan)
        >>> step = pipeline_step(model, optax.adamw(1e-3), mesh, plan, layout=layout)
    """
    blocks_per_stage(params, plan)  # refuses a tree the pipeline cannot split
    unit = {
        "embed": params["embed"],
        "blocks": jax.tree.map(lambda leaf: _host(leaf, 0), params["blocks"]),
        "head": params["head"],
    }
    topology = plan.topology
    shard = topology.dp_shard
    return param_layout(
        unit, world_size=topology.dp, dp_shard=None if shard == topology.dp else shard
    )


def pipeline_params(
    params: Any,
    plan: PipelinePlan,
    mesh: Mesh | None = None,
    specs: Any = None,
    *,
    layout: ParamLayout | None = None,
) -> Any:
    """Natural layout (blocks ``(L, ...)``) to pipeline layout (every leaf ``(pp, ...)``).

    The arrays are rearranged on the host (NumPy); with ``mesh`` they are placed sharded
    over its ``pp`` axis (and as ``specs`` says: ``pipeline_specs``), so each device receives
    only its own stages. A ``zero3`` plan's parameters are cut as ``layout`` says
    (``pipeline_layout``, its default): every layer in torch's layout, padded, its rows
    split over the data-parallel axis (``"dp"``, or a hybrid-sharding topology's
    ``"dp_shard"``), so each device receives its chunk of its own stages.

    Raises:
        ValueError: as ``blocks_per_stage``; ``layout`` with a plan that is not ``zero3``.

    Example:
        >>> p = pipeline_params({"embed": e, "blocks": b, "head": h}, plan, mesh)
        >>> natural_params(p, plan)["blocks"]["w"].shape == b["w"].shape
        True
    """
    k = blocks_per_stage(params, plan)
    out = jax.tree.map(lambda leaf, part: _to_pipeline(leaf, part, plan, k), params, _parts(params))
    _check_zero3(plan, layout, "pipeline_params")
    if plan.zero3:
        layout = pipeline_layout(params, plan) if layout is None else layout
        out = shard_tree(out, layout, layout.world_size)
    if mesh is None:
        return out
    if layout is not None:
        wanted = sharded_specs(params, check_mesh(layout, mesh, "dp"))
    else:
        wanted = pipeline_specs(params, specs)
    shardings = jax.tree.map(lambda spec: NamedSharding(mesh, spec), wanted, is_leaf=_is_spec)
    return jax.device_put(out, shardings)


def natural_params(params: Any, plan: PipelinePlan, *, layout: ParamLayout | None = None) -> Any:
    """Pipeline layout back to natural layout, as NumPy arrays (pipeline rank 0's copy of
    the embedding and head: every rank's is the same); a ``zero3`` plan's chunks put
    together as ``layout`` (the step's ``layout``) cut them.

    Raises:
        ValueError: for a ``zero3`` plan without its ``layout``, or ``layout`` with another.
    """
    _check_zero3(plan, layout, "natural_params", required=True)
    if layout is not None:
        params = unshard_tree(params, layout)
    return jax.tree.map(lambda leaf, part: _to_natural(leaf, part, plan), params, _parts(params))


def _check_zero3(
    plan: PipelinePlan, layout: ParamLayout | None, what: str, *, required: bool = False
) -> None:
    if layout is not None and not plan.zero3:
        raise ValueError(
            f"{what} got a layout, which cuts a zero3 plan's parameters, but the plan has "
            "zero3=False; drop layout= or plan with zero3=True"
        )
    if required and plan.zero3 and layout is None:
        raise ValueError(
            f"{what} of a zero3 plan needs the layout that cut the parameters: pass "
            "layout=step.layout (or pipeline_layout(natural, plan))"
        )


def natural_state(
    inner: optax.GradientTransformation, states: list[Any], params: Any, plan: PipelinePlan
) -> Any:
    """The state ``inner.init`` would give the natural parameters, from each pipeline rank's
    state of its own parameters (``states[r]``, its parameter-shaped leaves ``(1, ...)``).

    Exact for an elementwise ``inner`` (the pipeline step refuses others): a parameter-shaped
    leaf is put together as the parameters are; any other leaf (a step count) is the same on
    every rank, rank 0's is kept.
    """
    stacked = jax.tree.map(lambda *leaves: np.stack([np.asarray(x) for x in leaves]), *states)
    return optax.tree_map_params(
        inner,
        lambda leaf, part: _to_natural(leaf[:, 0], part, plan),
        stacked,
        _parts(params),
        transform_non_params=lambda leaf: leaf[0],
    )


def pipeline_state(
    inner: optax.GradientTransformation, state: Any, params: Any, plan: PipelinePlan, k: int
) -> list[Any]:
    """``natural_state``'s inverse: each pipeline rank's state of its own parameters (the
    stages hold ``k`` blocks each)."""
    stacked = optax.tree_map_params(
        inner,
        lambda leaf, part: _to_pipeline(leaf, part, plan, k)[:, None],
        state,
        _parts(params),
        transform_non_params=lambda leaf: np.broadcast_to(
            np.asarray(leaf), (plan.pp, *np.shape(leaf))
        ),
    )
    return [jax.tree.map(lambda leaf, r=r: leaf[r], stacked) for r in range(plan.pp)]
