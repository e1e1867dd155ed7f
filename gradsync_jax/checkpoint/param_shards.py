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

from gradsync_core import Manifest, ShardPlan, read_manifest
from gradsync_core.checkpoint import (
    Window,
    data_extra,
    hash_share,
    model_key,
    plan_dim0_shards,
    reading_version,
    resolve_checkpoint,
    restore_data,
    state_reads,
    verify_file_hashes,
    weight_reads,
)
from gradsync_core.deprecation import renamed_keywords
from gradsync_jax.checkpoint import optimizers
from gradsync_jax.checkpoint.model_state import check_weights
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


@renamed_keywords(directory="path", optimizer="optimizer_name")
def save_param_shards(
    path: str | os.PathLike[str],
    zero3: Zero3Step,
    params: Any,
    opt_state: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    data: Any = None,
) -> Manifest:
    """Write a ``zero3_step`` training state to the checkpoint directory ``path`` (replaced
    only once complete).

    Args:
        path: the checkpoint directory.
        zero3: the ``zero3_step`` that trains ``params`` and ``opt_state``.
        params: the sharded parameters (``shard_params``), stored whole as model weights.
        opt_state: its optimizer state (``zero3.init``), stored per parameter in model space.
            With several JAX processes every process makes this call.
        step: the training step, stored in the manifest.
        optimizer_name: a name checked on load (default: the canonical one, ``"adamw"``).
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
        path,
        lambda: _prepare(
            rows,  # type: ignore[arg-type]  # _RowShards answers what _prepare asks of tx
            rows,  # type: ignore[arg-type]  # and of the layout
            host_state,
            None,
            step,
            optimizer_name,
            layout.modules,
            model,
            inner=zero3.tx,
        ),
        mine=mine,
        n=n,
        extra={**position, "param_shard_plan": layout.plan.to_json()},
        what=f"cannot save ZeRO-3 checkpoint {os.fspath(path)}",
    )


@renamed_keywords(directory="path", optimizer="optimizer_name")
def load_param_shards(
    path: str | os.PathLike[str],
    zero3: Zero3Step,
    *,
    optimizer_name: str | None = None,
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
        path: the checkpoint.
        zero3: the ``zero3_step`` to continue with (its layout's device count may differ
            from the saver's).
        optimizer_name: the name given at save time, if one was.
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
    shown = os.fspath(path)
    version = resolve_checkpoint(path)  # one version, even while a save switches it
    rows = _RowShards(zero3)
    optimizer = optimizer_name or optimizers.optimizer_name(rows.space.state_types)
    weights, state, manifest = agreed_read(
        lambda: _read_held(version, zero3, rows, optimizer, allow_nonfinite),
        version,
        f"cannot load ZeRO-3 checkpoint {shown}",
    )
    _warn_hyperparams(shown, manifest, zero3.tx, optimizer)
    restore_data(manifest.extra, data, version)  # the load can no longer fail
    params = [_put(zero3, P(zero3.axes), leaf) for leaf in weights]
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs, treedef = jax.tree.flatten(zero3.state_specs, is_leaf=is_spec)
    placed = [_put(zero3, spec, leaf) for leaf, spec in zip(state, specs, strict=True)]
    return (
        jax.tree_util.tree_unflatten(zero3.layout.treedef, params),
        jax.tree.unflatten(treedef, placed),
        manifest,
    )


class _Chunks:
    """One leaf's chunks on this process's devices (``sharding``): the global shape of its
    ``n`` padded dim-0 chunks in torch's layout, a zeroed buffer per distinct dim-0 slice (a
    replica held twice is read once) and, per window of rows it holds, the buffer's rows."""

    def __init__(
        self, sharding: NamedSharding, leaf: LeafLayout, n: int, dtype: Any, name: str, key: str
    ) -> None:
        self.key = key  # the checkpoint tensor, as errors name it (parameter ``name``'s)
        self.shape = (leaf.padded_rows * n, *leaf.torch_shape[1:])
        row = int(np.prod(leaf.torch_shape[1:], dtype=np.int64))
        self.buffers: dict[Any, np.ndarray] = {}
        self.windows: dict[Window, np.ndarray] = {}
        for index in sharding.addressable_devices_indices_map(self.shape).values():
            assert index is not None  # a NamedSharding gives every device its index
            first, last, _ = index[0].indices(self.shape[0])
            if (first, last) in self.buffers:
                continue
            buffer = self.buffers[(first, last)] = np.zeros((last - first, *self.shape[1:]), dtype)
            held = min(last, leaf.rows) - first
            if held > 0:  # rows [first, first + held): elements [first·row, ...) flattened
                window = Window(name=name, start=first * row, stop=(first + held) * row)
                self.windows[window] = buffer[:held].reshape(-1)

    def fill_from(self, whole: np.ndarray) -> None:
        """Fill every window from the whole tensor (torch layout)."""
        flat = whole.reshape(-1)
        for window, rows in self.windows.items():
            rows[:] = flat[window.start : window.stop]

    def nonfinite(self) -> int:
        return sum(nonfinite(buffer) for buffer in self.buffers.values())


def _read_held(
    version: str, zero3: Zero3Step, rows: _RowShards, optimizer: str, allow_nonfinite: bool
) -> tuple[list[Any], list[Any], Manifest]:
    """Check the checkpoint version ``version`` and read this process's rows of it: every
    check on the headers first, then the core's reads of the windows of its devices' rows
    (``weight_reads``, ``state_reads``), each read into its chunk. Returns the ``_Chunks`` of
    each parameter, and of each state leaf (a global leaf or the count: its whole value)."""
    layout, n = zero3.layout, zero3.layout.world_size
    is_spec = lambda x: isinstance(x, P)  # noqa: E731
    specs = jax.tree.leaves(zero3.state_specs, is_leaf=is_spec)
    sharded = NamedSharding(zero3.mesh, P(zero3.axes))
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
            weights = [
                _Chunks(sharded, leaf, n, leaf.dtype, name, model_key(name))
                for leaf, name in zip(layout.leaves, names, strict=True)
            ]
            state: list[Any] = []
            whole: dict[str, np.ndarray] = {}  # the global leaves read
            by_param: dict[str, dict[str, _Chunks]] = {}  # name -> state key -> chunks
            for i, (leaf, value, spec) in enumerate(
                zip(rows.space.leaves, values, specs, strict=True)
            ):
                key = _state_key(manifest, rows.space, state_names, i)
                if leaf.param is None:  # a global leaf, or the count (the manifest's step)
                    if key in shapes:
                        value = whole[key] = stored.read_state({key: value})[key]
                    state.append(value)
                    continue
                part = rows.trainable[leaf.param]
                if leaf.shape != part.shape:
                    raise ValueError(
                        f"the state leaf {leaf.name!r} is {leaf.shape}, not its parameter's "
                        f"{part.shape}: ZeRO-3 keeps only state shaped like the parameters"
                    )
                name, _, state_key = key.rpartition("/")
                sharding = NamedSharding(zero3.mesh, spec)
                chunks = _Chunks(sharding, part, n, leaf.dtype, name, key)
                state.append(chunks)
                if manifest.version == 1:  # Flax's layout, whole: cut from the whole tensor
                    chunks.fill_from(np.transpose(stored.read_state({key: value})[key], part.perm))
                else:
                    by_param.setdefault(name, {})[state_key] = chunks
            windows = {w: buffer for c in weights for w, buffer in c.windows.items()}
            owners = manifest.extra["model"]
            for read in weight_reads(owners, manifest.world_size, windows):
                stored.read_piece(read, read.keys[0], windows[read.window])
            _read_state(stored, manifest, by_param)
    # NaN and inf in what was read: refused in weights always, in the state unless allowed.
    bad = [(chunks.key, chunks.nonfinite()) for chunks in weights]
    if not allow_nonfinite:
        bad += [(leaf.key, leaf.nonfinite()) for leaf in state if isinstance(leaf, _Chunks)]
        bad += [(key, nonfinite(value)) for key, value in whole.items()]
    for key, count in bad:
        refuse_nonfinite(key, count)
    return weights, state, manifest


def _read_state(
    stored: StoredFiles, manifest: Manifest, by_param: dict[str, dict[str, _Chunks]]
) -> None:
    """Read the windows of every parameter's state chunks (one plan of reads for all)."""
    keys = {name: sorted(chunks) for name, chunks in by_param.items()}
    windows = []
    for name, chunks in by_param.items():
        first = chunks[keys[name][0]].windows
        assert all(c.windows.keys() == first.keys() for c in chunks.values())  # same rows
        windows += list(first)
    for read in state_reads(manifest.plan, windows, keys):
        for full_key, state_key in zip(read.keys, keys[read.window.name], strict=True):
            rows = by_param[read.window.name][state_key].windows[read.window]
            stored.read_piece(read, full_key, rows)


def _put(zero3: Zero3Step, spec: P, leaf: Any) -> Any:
    """One global array from this process's chunks, or from a replicated whole value."""
    sharding = NamedSharding(zero3.mesh, spec)
    if not isinstance(leaf, _Chunks):
        whole = np.asarray(leaf)
        return jax.make_array_from_callback(whole.shape, sharding, lambda index: whole[index])

    def chunk(index: Any) -> np.ndarray:
        first, last, _ = index[0].indices(leaf.shape[0])
        return leaf.buffers[(first, last)][(slice(None), *index[1:])]

    return jax.make_array_from_callback(leaf.shape, sharding, chunk)
