"""Flax models as pipelines: an embedding, a stack of blocks and a head, NNX or linen.

The blocks are stacked the way Flax scans layers: NNX builds them under ``nnx.vmap`` (each
parameter gets a leading layer dimension) and runs them with ``nnx.scan``; linen builds them
with ``nn.scan`` or ``nn.vmap`` over the block. The pipeline runs one block at a time, so it
needs the block's own program and the stacked parameters; these functions return both, as a
``PipelineModel`` and the natural-layout parameters ``{"embed", "blocks", "head"}``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from gradsync_jax.pipeline.model import PipelineModel

Loss = Callable[[Any, Any], jax.Array]  # loss(head outputs, targets) -> scalar mean


def nnx_model(embed: Any, blocks: Any, head: Any, loss: Loss) -> tuple[PipelineModel, Any, Any]:
    """A pipeline of three NNX modules, their parameters in natural layout and their specs.

    Args:
        embed: the module applied to the inputs (``nnx.Embed``, ...).
        blocks: ONE block module whose parameters are stacked on a leading layer dimension
            (made under ``nnx.vmap``, as for ``nnx.scan``); the pipeline calls it with one
            layer's parameters at a time.
        head: the module applied to the last block's output (final norm, output layer).
        loss: ``loss(head(x), targets) -> scalar``, the mean over the microbatch.

    Returns:
        ``(model, params, specs)``: ``params = {"embed", "blocks", "head"}`` as pure dicts
        (``nnx.to_pure_dict``), ready for ``pipeline_params``; ``specs`` their
        ``PartitionSpec`` from the modules' ``out_sharding`` (``P()`` where unannotated; a
        block's is one layer's), ``pipeline_step``'s ``param_specs`` for tensor-parallel
        blocks. After training, write the parameters back with ``nnx.update(module,
        nnx_state(module, natural[part]))``.

    Raises:
        ValueError: if a module holds state other than ``nnx.Param`` (batch statistics,
            RNG streams), which the pipeline does not carry between ticks.

    Example:
        >>> model, params, specs = nnx_model(net.embed, net.blocks, net.head, cross_entropy)
        >>> step = pipeline_step(model, optax.adamw(1e-3), mesh, plan)
    """
    parts, specs, defs = {}, {}, {}
    for name, module in (("embed", embed), ("blocks", blocks), ("head", head)):
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)  # type: ignore[misc]
        if jax.tree.leaves(rest):
            kinds = sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=_is_var)})
            raise ValueError(
                f"the {name} module holds state other than nnx.Param ({', '.join(kinds)}); "
                "the pipeline carries only parameters between ticks: move RNG streams and "
                "batch statistics out of the pipelined modules"
            )
        parts[name] = nnx.to_pure_dict(params)
        specs[name] = nnx.to_pure_dict(nnx.get_partition_spec(params))
        defs[name] = graphdef

    def run(name: str) -> Callable[[Any, Any], Any]:
        graphdef = defs[name]
        return lambda p, x: nnx.merge(graphdef, p)(x)

    embed_fn, block_fn, head_fn = run("embed"), run("blocks"), run("head")
    model = PipelineModel(
        embed=embed_fn, block=block_fn, head=lambda p, x, y: loss(head_fn(p, x), y)
    )
    return model, parts, specs


def nnx_state(module: Any, params: Any) -> Any:
    """``params`` (a pure dict, ``natural_params(...)[part]``) as ``module``'s ``nnx.State``,
    for ``nnx.update(module, nnx_state(module, params))``."""
    state = nnx.state(module, nnx.Param)
    nnx.replace_by_pure_dict(state, params)
    return state


def linen_model(embed: Any, block: Any, head: Any, loss: Loss) -> PipelineModel:
    """A pipeline of three linen modules (their ``apply`` on ``{"params": ...}``).

    Args:
        embed: the module applied to the inputs.
        block: ONE block (not the scanned stack): its parameters are one layer of the stacked
            parameters that ``nn.scan`` or ``nn.vmap`` made. A block written for ``nn.scan``
            returns ``(carry, output)``: the carry is the activations passed on.
        head: the module applied to the last block's output.
        loss: ``loss(head(x), targets) -> scalar``, the mean over the microbatch.

    Returns:
        The ``PipelineModel``; its parameters are ``{"embed": ..., "blocks": <the scanned
        stack's params>, "head": ...}`` (the ``"params"`` collection of each).

    Example:
        >>> model = linen_model(Embed(), Block(), Head(), cross_entropy)
        >>> natural = {"embed": p["embed"], "blocks": p["layers"], "head": p["head"]}
    """

    def apply(module: Any) -> Callable[[Any, Any], Any]:
        return lambda p, x: module.apply({"params": p}, x)

    embed_fn, block_fn, head_fn = apply(embed), apply(block), apply(head)

    def carry(p: Any, x: Any) -> Any:
        out = block_fn(p, x)
        return out[0] if isinstance(out, tuple) else out

    return PipelineModel(embed=embed_fn, block=carry, head=lambda p, x, y: loss(head_fn(p, x), y))


def _is_var(x: Any) -> bool:
    return isinstance(x, nnx.Variable)
