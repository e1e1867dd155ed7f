"""Checkpoints that cross layouts, JAX side: a state laid out on a mesh, saved in model space.

Loaded under any layout, in either framework (docs/checkpoints.md, "A checkpoint that crosses
layouts").

Each parameter is a ``jax.Array`` whose ``NamedSharding`` gives every device of the mesh a
*box* of it (a range along every dim: tensor parallelism's columns or rows, the experts of
its ``ep`` coordinate, the rows of its ``dp_shard`` chunk), and device ``mesh.devices.flat[r]``
is rank ``r`` (``mesh_from_topology``). ``save_boxes`` turns those boxes into the core's
``"dim0"`` plan of flat element ranges (``gradsync_core.checkpoint.plan_box_shards``, the plan
gradsync_torch's ``save_boxes`` writes for the same layout): rank ``r``'s file holds the
ranges of the block its box belongs to, each element once, and the weights whole in their
owners' files. The files are written by ``gradsync_jax.checkpoint.zero``'s preparation (one
implementation of the Optax-to-torch mapping: torch's names, layouts and state keys, Optax's
``count`` as torch's ``step``), so every gradsync loader reads them: torch's ``load_boxes``
under any torch layout, ``load_model_weights`` / ``load_optimizer_state_dict`` in one torch
process, ``load_params`` / ``load_optimizer_state`` here, and ``load_boxes`` below.

With several JAX processes the parameters and state are gathered to every process first (as
``save_param_shards`` does) and each process writes its own devices' rank files; a load reads
the whole tensors and places them (one process holding every device reads every byte anyway).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Literal, overload

import jax
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Manifest, ParamSpec, SaveHandle, ShardPlan
from gradsync_core.checkpoint import (
    LAYOUT,
    Box,
    data_extra,
    distinct_boxes,
    plan_box_shards,
    resolve_checkpoint,
)
from gradsync_jax._naming import _is_kernel, _torch_shape
from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.processes import local_ranks, local_view
from gradsync_jax.checkpoint.zero import _prepare, load_optimizer_state, save_rank_files
from gradsync_jax.zero.model_space import ModelSpace, abstract, model_space, pure

PARTITION = "boxes"  # extra["partition"] of a save under a mesh layout


def _mesh_of(params: Any) -> Any:
    """The one mesh every parameter is placed on (a ``NamedSharding``'s)."""
    meshes = set()
    for leaf in jax.tree.leaves(params):
        sharding = getattr(leaf, "sharding", None)
        placed = isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct))
        if not placed or not isinstance(sharding, NamedSharding):
            raise ValueError(
                f"a parameter of shape {np.shape(leaf)} has no NamedSharding; give jax.Arrays "
                "placed on the mesh (jax.device_put), or ShapeDtypeStructs with sharding="
            )
        meshes.add(sharding.mesh)
    if len(meshes) != 1:
        raise ValueError(
            f"the parameters are placed on {len(meshes)} meshes; place them all on the one "
            "mesh the training step runs on"
        )
    return meshes.pop()


def _torch_box(name: str, rank: int, index: tuple[slice, ...], shape: tuple[int, ...]) -> Box:
    """A device's ``index`` into the Flax array ``name`` as a box of its torch layout
    (a kernel's dims reversed as ``to_torch_layout`` reverses them)."""
    start = [s.indices(n)[0] for s, n in zip(index, shape, strict=True)]
    stop = [s.indices(n)[1] for s, n in zip(index, shape, strict=True)]
    if _is_kernel(name) and len(shape) >= 2:
        perm = (len(shape) - 1, len(shape) - 2, *range(len(shape) - 2))
        start, stop = [start[d] for d in perm], [stop[d] for d in perm]
    return Box(name=name, rank=rank, start=tuple(start), stop=tuple(stop))


class _BoxShards:
    """A plain Optax state over placed parameters as ``zero``'s preparation reads a
    ``shard_optimizer`` and its layout: ``plan(_)``, ``world_size``, ``partition``, ``space``
    and ``gather(state)``."""

    partition = PARTITION

    def __init__(self, tx: optax.GradientTransformation, params: Any) -> None:
        mesh = _mesh_of(params)
        self.world_size = mesh.devices.size
        self.space: ModelSpace = model_space(tx, pure(abstract(params)))
        rank = {device: r for r, device in enumerate(mesh.devices.flat)}
        specs: list[ParamSpec] = []
        boxes: list[Box] = []
        for spec, leaf in zip(self.space.specs, jax.tree.leaves(params), strict=True):
            shape = tuple(leaf.shape)
            specs.append(replace(spec, shape=_torch_shape(spec.name, shape)))
            for device, index in leaf.sharding.devices_indices_map(shape).items():
                boxes.append(_torch_box(spec.name, rank[device], index, shape))
        self._plan = plan_box_shards(
            specs, distinct_boxes(boxes, specs), {}, world_size=self.world_size
        )
        self.mesh = mesh

    def plan(self, _params: Any) -> ShardPlan:
        """The boxes' ``"dim0"`` plan, named by Flax paths (``torch_plan`` renames it)."""
        return self._plan

    def gather(self, host_state: Any) -> list[Any]:
        """The state's leaves, whole (Flax layout), in the model space's order."""
        return [np.asarray(v) for v in jax.tree.leaves(host_state)]


@overload
def save_boxes(
    path: str | os.PathLike[str],
    params: Any,
    opt_state: Any,
    tx: optax.GradientTransformation,
    *,
    step: int,
    layout: Mapping[str, Any] | None = None,
    modules: Mapping[str, str] | None = None,
    optimizer_name: str | None = None,
    data: Any = None,
    blocking: Literal[True] = True,
) -> Manifest: ...


@overload
def save_boxes(
    path: str | os.PathLike[str],
    params: Any,
    opt_state: Any,
    tx: optax.GradientTransformation,
    *,
    step: int,
    layout: Mapping[str, Any] | None = None,
    modules: Mapping[str, str] | None = None,
    optimizer_name: str | None = None,
    data: Any = None,
    blocking: Literal[False],
) -> SaveHandle: ...


def save_boxes(
    path: str | os.PathLike[str],
    params: Any,
    opt_state: Any,
    tx: optax.GradientTransformation,
    *,
    step: int,
    layout: Mapping[str, Any] | None = None,
    modules: Mapping[str, str] | None = None,
    optimizer_name: str | None = None,
    data: Any = None,
    blocking: bool = True,
) -> Manifest | SaveHandle:
    """Write a training state laid out on a mesh as a checkpoint any layout loads.

    The same format and plan as gradsync_torch's ``save_boxes``: model space (torch's names,
    layouts and state keys), each parameter's optimizer state as flat element ranges, rank
    ``r``'s file the ranges of the block its device's box belongs to, each weight whole in
    one file; ``extra["layout"]`` the ``layout`` record.

    Args:
        path: the checkpoint directory (switched atomically, as every gradsync save).
        params: the parameter tree (e.g. ``nnx.to_pure_dict`` of an NNX model's
            ``nnx.Param`` state), each leaf a ``jax.Array`` placed on one mesh with a
            ``NamedSharding`` (``mesh_from_topology``: device ``mesh.devices.flat[r]`` is
            rank ``r``).
        opt_state: ``tx.init(params)``'s state as trained (its leaves placed anyhow).
        tx: the plain Optax transformation (``optax.chain(clip, optax.adamw(...))``).
        step: the training step, stored in the manifest.
        layout: ``gradsync_core.checkpoint.layout_record(topology, framework="jax", ...)``,
            stored as ``extra["layout"]`` (``gradsync checkpoint inspect`` prints it).
        modules: Flax-to-torch module renames (see ``torch_name``).
        optimizer_name: a name checked on load (default: the canonical one, ``"adamw"``).
        data: a ``ResumableSampler`` whose position the manifest stores.
        blocking: ``False``: return once this process's rank files are copied to host
            staging memory; the rest runs in the background (``SaveHandle``), as
            ``save_optimizer_state(blocking=False)``.

    Returns:
        The manifest; with ``blocking=False`` a ``SaveHandle`` whose ``wait()`` returns it.

    Raises:
        ValueError: a parameter not placed on the one mesh (before any collective); on
            every process a ``CheckpointError`` naming the one whose part failed, the
            previous checkpoint kept.

    Example:
        >>> save_boxes("ckpt/step100", stored, opt_state, tx, step=100)  # doctest: +SKIP
    """
    rows = _BoxShards(tx, params)
    position = data_extra(data)
    # Collectives first, so every process takes part: each then holds the whole state.
    host_state = local_view(opt_state, complete=True)
    model = local_view(params, complete=True)
    all_axes = tuple(rows.mesh.axis_names)
    mine = sorted(local_ranks(rows.mesh, all_axes))
    extra: dict[str, Any] = dict(position)
    if layout is not None:
        extra[LAYOUT] = dict(layout)
    return save_rank_files(
        path,
        lambda: _prepare(
            rows,  # type: ignore[arg-type]  # _BoxShards answers what _prepare asks of tx
            rows,  # type: ignore[arg-type]  # and of the layout
            host_state,
            None,
            step,
            optimizer_name,
            modules,
            model,
            inner=tx,
        ),
        mine=mine,
        n=rows.world_size,
        extra=extra,
        what=f"cannot save checkpoint {os.fspath(path)}",
        blocking=blocking,
    )


def load_boxes(
    path: str | os.PathLike[str],
    params: Any,
    tx: optax.GradientTransformation,
    *,
    modules: Mapping[str, str] | None = None,
    optimizer_name: str | None = None,
    data: Any = None,
    allow_nonfinite: bool = False,
    allow_dtype_conversion: bool = False,
) -> tuple[Any, Any, Manifest]:
    """Load any gradsync checkpoint holding model weights into a layout on a mesh.

    Saved under any layout, by either framework (``save_boxes`` of gradsync_torch or of
    this module, ``save_optimizer_state(model=)``, ``save_param_shards``): the weights and
    the optimizer state are checked (every file's hash, names, shapes, dtypes, state keys,
    finite values) before anything is placed; then each leaf is placed with its
    parameter's ``NamedSharding`` (the state's per-parameter leaves likewise, the rest
    replicated). Nothing is changed on a refusal: the result is a new state.

    Args:
        path: the checkpoint.
        params: the target layout: the parameter tree with each leaf a ``jax.Array`` or a
            ``jax.ShapeDtypeStruct`` carrying the ``NamedSharding`` to place it with.
        tx: the plain Optax transformation ``tx.init(params)`` belongs to.
        modules: Flax-to-torch module renames given at save time.
        optimizer_name: the name given at save time, if one was.
        data: a ``ResumableSampler`` positioned where the checkpoint's data was (last).
        allow_nonfinite: take NaN or inf as they are.
        allow_dtype_conversion: cast weights stored in another floating dtype.

    Returns:
        ``(params, opt_state, manifest)``, placed; ``manifest.extra["layout"]`` says where
        the checkpoint was saved.

    Raises:
        ValueError: one sentence naming what differs (another model, dtype, optimizer,
            missing or corrupt file), before anything is placed or ``data`` moves.

    Example:
        >>> stored, opt_state, manifest = load_boxes("ckpt/step100", stored, tx)  # doctest: +SKIP
    """
    mesh = _mesh_of(params)
    like = abstract(params)
    version = resolve_checkpoint(path)  # one version for both reads
    weights = load_params(
        version,
        like,
        modules=modules,
        allow_dtype_conversion=allow_dtype_conversion,
        allow_nonfinite=allow_nonfinite,
    )
    state, manifest = load_optimizer_state(
        version,
        tx,
        like,
        optimizer_name=optimizer_name,
        modules=modules,
        data=data,
        allow_nonfinite=allow_nonfinite,
    )
    shardings = jax.tree.map(lambda leaf: leaf.sharding, params)
    state_shardings = optax.tree_map_params(
        tx,
        lambda _, sharding: sharding,
        state,
        shardings,
        transform_non_params=lambda _: NamedSharding(mesh, P()),
    )
    return jax.device_put(weights, shardings), jax.device_put(state, state_shardings), manifest
