"""A pipeline step's checkpoint: the usual gradsync format, in model space (docs/pipeline.md).

What ``gradsync_torch.save_pipeline`` writes, from JAX: the weights and optimizer state of the
whole model under its torch names, as the unpipelined model's optimizer would hold them, so
it continues at any pp, schedule or optimizer sharding, in JAX (``load_pipeline``) or in torch
(``gradsync_torch.load_pipeline``, ``load_model_weights``). The pipeline layout goes to the
natural one (``natural_params``, ``PipelineStep.natural_state``) and then to the sequential
one (``sequential_params``: the blocks one per layer, torch's ``nn.Sequential`` names); the
files are written and read by the checkpoint functions every JAX training state uses
(``save_optimizer_state`` through a one-device ``shard_optimizer``, ``load_params``,
``load_optimizer_state`` with the plain Optax transformation).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any, Literal, overload

import jax
import numpy as np
from jax.sharding import Mesh

from gradsync_core import Manifest, SaveHandle
from gradsync_core.checkpoint import resolve_checkpoint, restore_data
from gradsync_jax.checkpoint import load_optimizer_state, load_params, save_optimizer_state
from gradsync_jax.pipeline.layout import (
    natural_params,
    pipeline_params,
    sequential_params,
    stacked_params,
)
from gradsync_jax.pipeline.model import PARTS
from gradsync_jax.pipeline.step import PipelineStep
from gradsync_jax.zero import shard_optimizer


def _is_natural(x: Any) -> bool:
    return isinstance(x, dict) and set(x) == set(PARTS)


def _is_sequential(x: Any) -> bool:
    return isinstance(x, dict) and len(x) >= 3 and set(x) == {str(i) for i in range(len(x))}


def _convert(
    state: Any, is_params: Callable[[Any], bool], convert: Callable[[Any], Any], want: Any
) -> Any:
    """``state`` with every parameter-shaped subtree converted; refused unless the result has
    ``want``'s structure (the state ``tx.init`` makes for the converted parameters)."""
    out = jax.tree.map(lambda x: convert(x) if is_params(x) else x, state, is_leaf=is_params)
    if str(jax.tree.structure(out)) != str(jax.tree.structure(want)):
        raise ValueError(
            "the optimizer state holds parameter-shaped values outside dicts like the "
            "parameters ({'embed', 'blocks', 'head'}), which a pipeline checkpoint cannot "
            "place; use an Optax transformation whose state mirrors the parameters (SGD, "
            "Adam, AdamW, Lion)"
        )
    return out


@overload
def save_pipeline(
    path: str | os.PathLike[str],
    pipeline: PipelineStep,
    params: Any,
    opt_state: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    data: Any = None,
    blocking: Literal[True] = True,
) -> Manifest: ...


@overload
def save_pipeline(
    path: str | os.PathLike[str],
    pipeline: PipelineStep,
    params: Any,
    opt_state: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    data: Any = None,
    blocking: Literal[False],
) -> SaveHandle: ...


def save_pipeline(
    path: str | os.PathLike[str],
    pipeline: PipelineStep,
    params: Any,
    opt_state: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    data: Any = None,
    blocking: bool = True,
) -> Manifest | SaveHandle:
    """Save a pipeline step's parameters and optimizer state as one model's.

    Args:
        path: the checkpoint path (written atomically: a failed save keeps the old
            one).
        pipeline: the ``pipeline_step`` that trains ``params``.
        params: its pipeline-layout parameters (``pipeline_params``).
        opt_state: its optimizer state (``pipeline.init``, or a step's).
        step: the training step, stored in the manifest.
        optimizer_name: a name checked on load (default: derived from the state's types).
        modules: renames of the sequential names to the torch model's (see ``torch_name``),
            e.g. ``{"0": "embedding"}``; default: torch's ``nn.Sequential(embedding,
            *blocks, head)`` names (``sequential_params``).
        data: a ``ResumableSampler`` whose position the manifest stores.
        blocking: ``False``: return once the whole model's state is copied to host staging
            memory; the file is written in the background (``save_optimizer_state`` says
            how).

    Returns:
        The manifest written; with ``blocking=False`` a ``SaveHandle`` whose ``wait()``
        returns it.

    Raises:
        ValueError: if the state does not mirror the parameters, and as
            ``save_optimizer_state`` (a ``CheckpointError`` for a failed write).

    Example:
        >>> save_pipeline("ckpt", step_fn, params, opt_state, step=100)  # doctest: +SKIP
    """
    model = sequential_params(natural_params(params, pipeline.plan, layout=pipeline.layout))
    inner = pipeline.inner
    want = jax.eval_shape(inner.init, model)
    state = _convert(
        pipeline.natural_state(opt_state, params), _is_natural, sequential_params, want
    )
    # one device holds the whole model's state, as torch's save_pipeline writes one file
    one = Mesh(np.asarray(pipeline.mesh.devices).reshape(-1)[:1], ("dp",))
    tx = shard_optimizer(inner, one)
    return save_optimizer_state(
        path,
        tx,
        tx.scatter_state(state, model),
        model,
        step=step,
        optimizer_name=optimizer_name,
        modules=modules,
        model=model,
        data=data,
        blocking=blocking,
    )


def load_pipeline(
    path: str | os.PathLike[str],
    pipeline: PipelineStep,
    like: Any,
    *,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    data: Any = None,
    allow_nonfinite: bool = False,
) -> tuple[Any, Any, Manifest]:
    """Read a checkpoint in model space into a pipeline step's parameters and state.

    The checkpoint may come from a JAX or torch pipeline of any size and schedule
    (``save_pipeline``, ``gradsync_torch.save_pipeline``), or from the unpipelined torch
    model (``ZeroRedundancyOptimizer.save(path, model=)``, ``save_plain``) under the
    sequential names. Everything is checked before anything is placed.

    Args:
        path: the checkpoint.
        pipeline: the ``pipeline_step`` to continue with.
        like: the natural-layout parameters (``nnx_model``'s), arrays or
            ``jax.ShapeDtypeStruct``: the shapes and dtypes the checkpoint must hold.
        optimizer_name: the name given at save time, if one was.
        modules: the renames given at save time (``save_pipeline``).
        data: a ``ResumableSampler`` to position where the checkpoint's data was.
        allow_nonfinite: take NaN or inf as they are.

    Returns:
        ``(params, opt_state, manifest)``: pipeline-layout parameters placed on the
        pipeline's mesh (``pipeline_params``) and the optimizer state for them.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different (another
            model, another optimizer).

    Example:
        >>> params, opt_state, _ = load_pipeline("ckpt", step_fn, natural)  # doctest: +SKIP
    """
    version = resolve_checkpoint(path)  # one version for the weights and the state
    model_like = sequential_params(like)
    model = load_params(version, model_like, modules=modules, allow_nonfinite=allow_nonfinite)
    state, manifest = load_optimizer_state(
        version,
        pipeline.inner,
        model,
        optimizer_name=optimizer_name,
        modules=modules,
        allow_nonfinite=allow_nonfinite,
    )
    natural = stacked_params(model)
    want = jax.eval_shape(pipeline.inner.init, natural)
    state = _convert(state, _is_sequential, stacked_params, want)
    params = pipeline_params(
        natural, pipeline.plan, pipeline.mesh, pipeline.param_specs, layout=pipeline.layout
    )
    opt_state = pipeline.pipeline_state(state, params)
    restore_data(manifest.extra, data, version)  # last: the load can no longer fail
    return params, opt_state, manifest
