"""Save and load a ZeRO-3 training state (``zero3_step``) in the gradsync checkpoint format.

The format is version 2 of docs/design.md §9: model space, torch's names, layouts and state
keys, one safetensors file per rank. A parameter-shard plan cuts every parameter in torch's
layout along dim 0, so the rows ``[lo, hi)`` device ``r`` holds are the elements
``[lo·k, hi·k)`` of the flattened tensor (``k`` elements per row, ``ParamChunk.element_range``):
a ``ShardPlan`` of kind ``"dim0"`` of those element ranges (``plan_dim0_shards``, the one
rule torch's ``save_fully_sharded`` uses too) says exactly what each rank file holds. Every
loader of the format already reads such a plan (torch's ``ZeroRedundancyOptimizer``, plain
optimizers and ``load_fully_sharded``, ``shard_optimizer``, plain Optax, and
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
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Manifest, ShardPlan, read_manifest
from gradsync_core.checkpoint import (
    MODEL_PARAM,
    data_extra,
    hash_share,
    model_key,
    plan_dim0_shards,
    reading_version,
    resolve_checkpoint,
    restore_data,
    verify_file_hashes,
)
from gradsync_jax.checkpoint.model_state import check_weights
from gradsync_jax.checkpoint.optimizers import optimizer_name
from gradsync_jax.checkpoint.processes import agreed_read, local_ranks, local_view
from gradsync_jax.checkpoint.stored import StoredFiles, nonfinite, refuse_nonfinite
from gradsync_jax.checkpoint.zero import (
    _check_loadable,
    _prepare,
    _state_key,
    _state_values,
    _warn_hyperparams,
    save_rank_files,
)
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout
from gradsync_jax.param_sharding.placement import unshard_params
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
            rows, rows, host_state, None, step, optimizer, layout.modules, model, inner=zero3.tx
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

    Each process reads only the rows its devices hold, of every weight and of its state
    (``gradsync_core.checkpoint.state_reads``), and the hashes of its share of the files;
    with several processes they then agree, so a check that fails on one fails the load on
    all (docs/jax-zero3.md).

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
        ValueError: one sentence naming what is missing, corrupt or different (with several
            processes a ``CheckpointError`` naming the process, on every process).

    Example:
        >>> params, opt_state, _ = load_param_shards("ckpt", step_fn)  # doctest: +SKIP
    """
    shown = os.fspath(directory)
    version = resolve_checkpoint(directory)  # one version, even while a save switches it
    rows = _RowShards(zero3)
    optimizer = optimizer or optimizer_name(rows.space.state_types)
    held, manifest = agreed_read(
        lambda: _read_held(version, zero3, rows, optimizer, allow_nonfinite),
        version,
        f"cannot load ZeRO-3 checkpoint {shown}",
    )
    _warn_hyperparams(shown, manifest, zero3.tx, optimizer)
    restore_data(manifest.extra, data, version)  # the load can no longer fail
    params = [_put(zero3, P(zero3.axes), *leaf) for leaf in held.params]
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs, treedef = jax.tree.flatten(zero3.state_specs, is_leaf=is_spec)
    state = [_put(zero3, spec, *leaf) for leaf, spec in zip(held.state, specs, strict=True)]
    return (
        jax.tree_util.tree_unflatten(zero3.layout.treedef, params),
        jax.tree.unflatten(treedef, state),
        manifest,
    )


class _Held(NamedTuple):
    """What this process read: for each leaf (the layout's parameters, the state's leaves in
    flattening order) its global shape and its devices' chunks by their dim-0 slice, or, for
    a replicated leaf, the whole value (key ``None``)."""

    params: list[tuple[tuple[int, ...], dict[Any, np.ndarray]]]
    state: list[tuple[tuple[int, ...], dict[Any, np.ndarray]]]


def _read_held(
    version: str, zero3: Zero3Step, rows: _RowShards, optimizer: str, allow_nonfinite: bool
) -> tuple[_Held, Manifest]:
    """Check the checkpoint version ``version`` and read this process's rows of it."""
    layout, n = zero3.layout, zero3.layout.world_size
    sharded = NamedSharding(zero3.mesh, P(zero3.axes))
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = jax.tree.leaves(zero3.state_specs, is_leaf=is_spec)
    with reading_version(version):  # a later save that removes it: a sentence, load again
        manifest = read_manifest(version, verify_files=False)
        mine = hash_share(version, manifest, jax.process_index(), jax.process_count())
        verify_file_hashes(version, manifest, mine)  # together, the processes check all
        with StoredFiles(version, manifest) as stored:
            like = _whole(layout, trainable_only=False)
            names = check_weights(stored.weights(), like, modules=layout.modules)
            state_names = _check_loadable(version, manifest, rows.space, optimizer, layout.modules)
            shapes = stored.state()
            values = _state_values(manifest, rows.space, state_names, shapes)  # every check
            bad: dict[str, int] = {}  # NaN and inf in what was read, by tensor
            weights = []
            for leaf, name in zip(layout.leaves, names, strict=True):
                weight_rows = _counted(partial(stored.weight_window, name), model_key(name), bad)
                weights.append(_chunks(sharded, leaf, n, leaf.dtype, weight_rows))
            state = []
            for i, (leaf, value, spec) in enumerate(
                zip(rows.space.leaves, values, specs, strict=True)
            ):
                key = _state_key(manifest, rows.space, state_names, i)
                if leaf.param is None:  # a global leaf, or the count (the manifest's step)
                    if key in shapes:
                        value = stored.whole(key, shapes[key].shape)
                        bad[key] = nonfinite(value)
                    state.append((np.shape(value), {None: np.asarray(value)}))
                    continue
                part = rows.trainable[leaf.param]
                if leaf.shape != part.shape:
                    raise ValueError(
                        f"the state leaf {leaf.name!r} is {leaf.shape}, not its parameter's "
                        f"{part.shape}: ZeRO-3 keeps only state shaped like the parameters"
                    )
                state_rows = _counted(_rows_of(stored, manifest, key, part, shapes[key]), key, bad)
                sharding = NamedSharding(zero3.mesh, spec)
                state.append(_chunks(sharding, part, n, leaf.dtype, state_rows))
    for key, count in bad.items():  # the weights first; the state unless allowed
        if not allow_nonfinite or key.startswith(MODEL_PARAM + "/"):
            refuse_nonfinite(key, count)
    return _Held(weights, state), manifest


def _counted(
    read: Callable[[int, int], np.ndarray], key: str, bad: dict[str, int]
) -> Callable[[int, int], np.ndarray]:
    """``read``, adding the NaN and inf of what it reads to ``bad[key]``."""
    bad.setdefault(key, 0)

    def counted(a: int, b: int) -> np.ndarray:
        part = read(a, b)
        bad[key] += nonfinite(part)
        return part

    return counted


def _rows_of(
    stored: StoredFiles, manifest: Manifest, key: str, leaf: LeafLayout, like: np.ndarray
) -> Callable[[int, int], np.ndarray]:
    """Elements ``[a, b)`` of state tensor ``key`` in torch's layout, flattened: read from the
    files as they are (format version 2 stores torch's layout), or, for version 1 (Flax's
    layout, whole tensors), cut from the whole tensor transposed."""
    if manifest.version >= 2:
        return lambda a, b: stored.window(key, a, b)
    whole = np.transpose(stored.whole(key, like.shape), leaf.perm).reshape(-1)
    return lambda a, b: whole[a:b]


def _chunks(
    sharding: NamedSharding,
    leaf: LeafLayout,
    n: int,
    dtype: Any,
    read: Callable[[int, int], np.ndarray],
) -> tuple[tuple[int, ...], dict[Any, np.ndarray]]:
    """The global shape of ``leaf``'s ``n`` padded dim-0 chunks (torch layout) and the chunk of
    each of this process's devices, by its dim-0 slice: its rows read with ``read(a, b)``
    (elements ``[a, b)``, flattened; each row once), then zero padding."""
    shape = (leaf.padded_rows * n, *leaf.torch_shape[1:])
    row = int(np.prod(leaf.torch_shape[1:], dtype=np.int64))
    chunks: dict[Any, np.ndarray] = {}
    for index in sharding.addressable_devices_indices_map(shape).values():
        assert index is not None  # a NamedSharding gives every device its index
        first, last, _ = index[0].indices(shape[0])
        if (first, last) in chunks:  # a replica of a chunk this process holds already
            continue
        chunk = np.zeros((last - first, *shape[1:]), dtype)
        held = min(last, leaf.rows) - first
        if held > 0:
            chunk[:held] = read(first * row, (first + held) * row).reshape(held, *shape[1:])
        chunks[(first, last)] = chunk
    return shape, chunks


def _put(zero3: Zero3Step, spec: P, shape: tuple[int, ...], chunks: dict[Any, np.ndarray]) -> Any:
    """One global array from this process's chunks (or a replicated whole value)."""
    sharding = NamedSharding(zero3.mesh, spec)
    if None in chunks:
        whole = chunks[None]
        return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])

    def chunk(index: Any) -> np.ndarray:
        first, last, _ = index[0].indices(shape[0])
        return chunks[(first, last)][(slice(None), *index[1:])]

    return jax.make_array_from_callback(shape, sharding, chunk)
