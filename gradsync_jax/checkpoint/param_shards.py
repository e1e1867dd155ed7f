"""Save and load a ZeRO-3 training state (``zero3_step``) in the gradsync checkpoint format.

The format is version 2 of docs/design.md §9: model space, torch's names, layouts and state
keys, one safetensors file per rank. A parameter-shard plan cuts every parameter in torch's
layout along dim 0, so the rows ``[lo, hi)`` device ``r`` holds are the elements
``[lo·k, hi·k)`` of the flattened tensor (``k`` elements per row, ``ParamChunk.element_range``):
a ``ShardPlan`` of kind ``"dim0"`` of those element ranges (``plan_dim0_shards``, the one
rule torch's ``save_param_shards`` uses too) says exactly what each rank file holds. Every
loader of the format already reads such a plan (torch's ``ZeroRedundancyOptimizer``, plain
optimizers and torch's ``load_param_shards``, ``shard_optimizer``, plain Optax, and
``load_param_shards`` at another device count), so no new reader is needed on either side.

The files are made by ``gradsync_jax.checkpoint.zero``'s preparation (one implementation of
the Optax-to-canonical mapping, ``count`` as torch's ``step``, global leaves and model weights):
``_RowShards`` gives it the plan and the model-space values it asks a ``shard_optimizer`` for.
The parameters are stored as model weights (``"__model__/<name>"``, whole, as §9 says), since
under ZeRO-3 the state alone cannot restart training. With several JAX processes the
parameters and the state are gathered to every process first (their host memory holds the
whole model once during the save); each process writes its own devices' rank files.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Manifest, ShardPlan
from gradsync_core.checkpoint import (
    data_extra,
    plan_dim0_shards,
)
from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.processes import local_ranks, local_view, place
from gradsync_jax.checkpoint.zero import _prepare, load_optimizer_state, save_rank_files
from gradsync_jax.param_sharding.layout import ParamLayout
from gradsync_jax.param_sharding.placement import padded_host, shard_params, unshard_params
from gradsync_jax.param_sharding.step import Zero3Step
from gradsync_jax.zero.model_space import ModelSpace, model_space, pure

PARTITION = "param_shards"  # extra["partition"] of a ZeRO-3 save


def _whole(layout: ParamLayout, *, trainable_only: bool) -> Any:
    """The Flax tree as ShapeDtypeStructs of the whole parameters (``None`` for frozen ones
    when ``trainable_only``: the tree the optimizer state belongs to)."""
    leaves = [
        None
        if trainable_only and not leaf.trainable
        else jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype))
        for leaf in layout.leaves
    ]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


class _RowShards:
    """A ZeRO-3 state as ``zero``'s preparation reads a ``shard_optimizer`` and its layout:
    ``plan(_)``, ``world_size``, ``partition``, ``space`` and ``gather(state)``."""

    partition = PARTITION

    def __init__(self, zero3: Zero3Step) -> None:
        self.layout = zero3.layout
        self.world_size = self.layout.world_size
        self.trainable = [leaf for leaf in self.layout.leaves if leaf.trainable]
        # ``pure``: an NNX state's Variables as plain values, as the loader analyses it
        # (otherwise their ``.value`` would be part of every name).
        whole = pure(_whole(self.layout, trainable_only=True))
        self.space: ModelSpace = model_space(zero3.tx, whole)

    def plan(self, _params: Any) -> ShardPlan:
        """Each trainable parameter's dim-0 rows per rank as element ranges (the core's
        ``plan_dim0_shards``, as torch's ZeRO-3 save), cut in torch's layout but named like
        ``space.specs`` (Flax paths; ``torch_plan`` renames them)."""
        specs = [
            replace(spec, shape=leaf.torch_shape)
            for spec, leaf in zip(self.space.specs, self.trainable, strict=True)
        ]
        return plan_dim0_shards(specs, [0] * len(specs), shard_size=self.world_size)

    def gather(self, host_state: Any) -> list[Any]:
        """The state's leaves in model space (whole, Flax layout) from its host copy."""
        values = []
        for leaf, value in zip(self.space.leaves, jax.tree.leaves(host_state), strict=True):
            if leaf.param is not None:
                layout = self.trainable[leaf.param]
                value = np.transpose(np.asarray(value)[: layout.rows], layout.inverse_perm)
            values.append(value)
        return values


def save_param_shards(
    directory: str | os.PathLike[str],
    zero3: Zero3Step,
    params: Any,
    opt_state: Any,
    *,
    step: int,
    optimizer: str | None = None,
    data: Any = None,
) -> Manifest:
    """Write a ``zero3_step`` training state to ``directory`` (replaced only once complete).

    Args:
        directory: the checkpoint directory.
        zero3: the ``zero3_step`` that trains ``params`` and ``opt_state``.
        params: the sharded parameters (``shard_params``), stored whole as model weights.
        opt_state: its optimizer state (``zero3.init``), stored per parameter in model space.
            With several JAX processes every process makes this call.
        step: the training step, stored in the manifest.
        optimizer: a name checked on load (default: the canonical one, ``"adamw"``).
        data: a ``ResumableSampler`` whose position the manifest stores.

    Returns:
        The manifest written; ``extra["partition"]`` is ``"param_shards"`` and
        ``extra["param_shard_plan"]`` the plan (torch names) the state was sharded by.

    Raises:
        CheckpointError: on every process, naming the one that failed; the previous
            checkpoint is kept.

    Example:
        >>> save_param_shards("ckpt", step_fn, params, opt_state, step=100)  # doctest: +SKIP
    """
    position = data_extra(data)
    layout = zero3.layout
    # Collectives first, so every process takes part: under ZeRO-3 a rank file's rows are
    # one device's shard, but the weights are stored whole (a gather either way).
    host_state = local_view(opt_state, complete=True)
    model = unshard_params(local_view(params, complete=True), layout)
    rows = _RowShards(zero3)
    mine = sorted(local_ranks(zero3.mesh, zero3.axes))
    n = layout.world_size

    return save_rank_files(
        directory,
        lambda: _prepare(
            rows,  # type: ignore[arg-type]  # _RowShards answers what _prepare asks of tx
            rows,  # type: ignore[arg-type]  # and of the layout
            host_state,
            None,
            step,
            optimizer,
            layout.modules,
            model,
            inner=zero3.tx,
        ),
        mine=mine,
        n=n,
        extra={**position, "param_shard_plan": layout.plan.to_json()},
        what=f"cannot save ZeRO-3 checkpoint {os.fspath(directory)}",
    )


def load_param_shards(
    directory: str | os.PathLike[str],
    zero3: Zero3Step,
    *,
    optimizer: str | None = None,
    data: Any = None,
    allow_nonfinite: bool = False,
) -> tuple[Any, Any, Manifest]:
    """Read a checkpoint into sharded parameters and optimizer state for ``zero3``.

    Any checkpoint of the format that holds model weights loads: a ZeRO-3 save at another
    device count, a ``save_optimizer_state(..., model=)`` of ZeRO-1, or a torch save
    (``ZeroRedundancyOptimizer.save(path, model=)``) whose optimizer is the counterpart of
    ``zero3.tx``. Every check (hashes, names, shapes, dtypes, state keys, finite values)
    runs before anything is placed; ``data`` is positioned last.

    Args:
        directory: the checkpoint.
        zero3: the ``zero3_step`` to continue with (its layout's device count may differ
            from the saver's).
        optimizer: the name given at save time, if one was.
        data: a ``ResumableSampler`` to position where the checkpoint's data was.
        allow_nonfinite: take NaN or inf in state tensors as they are.

    Returns:
        ``(params, opt_state, manifest)``, placed as ``shard_params`` and ``zero3.init``
        place them.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different.

    Example:
        >>> params, opt_state, _ = load_param_shards("ckpt", step_fn)  # doctest: +SKIP
    """
    layout = zero3.layout
    whole = load_params(directory, _whole(layout, trainable_only=False), modules=layout.modules)
    state, manifest = load_optimizer_state(
        directory,
        zero3.tx,
        _whole(layout, trainable_only=True),
        optimizer=optimizer,
        modules=layout.modules,
        data=data,
        allow_nonfinite=allow_nonfinite,
    )
    params = shard_params(whole, zero3.mesh, layout, axis_name=zero3.axes)
    return params, _place_state(zero3, state), manifest


def _place_state(zero3: Zero3Step, state: Any) -> Any:
    """The whole Flax-layout Optax state as ``zero3.init`` places it: per-parameter leaves
    padded in torch's layout and sharded, the others replicated."""
    rows = _RowShards(zero3)
    leaves = jax.tree.leaves(state)
    # The step's own structure (an NNX state's Variables kept), which the loaded plain
    # Optax state has leaf for leaf in the same order.
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs, treedef = jax.tree.flatten(zero3.state_specs, is_leaf=is_spec)
    host, shardings = [], []
    for leaf, value, spec in zip(rows.space.leaves, leaves, specs, strict=True):
        if leaf.param is not None:
            value = padded_host(rows.trainable[leaf.param], value, rows.world_size)
        host.append(np.asarray(value))
        shardings.append(NamedSharding(zero3.mesh, spec))
    return jax.tree.unflatten(treedef, place(host, shardings))
