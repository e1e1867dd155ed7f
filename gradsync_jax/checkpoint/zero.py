"""Save and load ``shard_optimizer`` state in the framework-neutral format (docs/checkpoints.md).

The files are the ones ``gradsync_torch``'s ZeRO optimizer writes (format version 2): a
manifest plus one safetensors file per rank, tensors named ``"<param name>/<state key>"`` in
model space with torch's names, layouts and state keys (``layers.0.weight/exp_avg``, Dense
kernels transposed to ``(out, in)``), so a checkpoint saved on 8 devices loads on 4, with the
other partition, or into ``torch``. Rank ``d``'s file holds what the manifest's plan gives
device ``d``: whole tensors (greedy) or the element range ``[start, stop)`` of the flattened
tensor (flat). Optax's ``count`` is stored as every parameter's ``step`` (a JSON number in
``extra["scalars"]``, as torch stores its ``step``); other leaves tied to no parameter (injected
hyper-parameters) go to rank 0's file under ``"__optax__/<state path>"``, listed in
``extra["global_keys"]``: only JAX reads those. With several JAX processes each writes its
own devices' rank files and process 0 the manifest (``gradsync_jax.checkpoint.processes``).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import Any, Literal, NamedTuple, overload

import jax
import numpy as np
import optax

from gradsync_core import HyperparameterWarning, Manifest, ParamSpec, read_manifest
from gradsync_core.checkpoint import (
    SaveHandle,
    SaveSteps,
    canonical_optimizer,
    check_compatible,
    check_state_keys,
    counterpart_keys,
    data_extra,
    hyperparameter_warning,
    rank_file,
    rank_file_metadata,
    reading_version,
    resolve_checkpoint,
    restore_data,
    run_save,
    start_save,
    tensor_file,
    tensor_key,
    write_rank_file,
)
from gradsync_core.deprecation import renamed_keywords
from gradsync_jax._naming import from_torch_layout, to_torch_layout, torch_name, torch_plan
from gradsync_jax.checkpoint import optimizers
from gradsync_jax.checkpoint.hyperparams import measure_hyperparams
from gradsync_jax.checkpoint.model_state import weights_by_rank
from gradsync_jax.checkpoint.optimizers import canonical_key
from gradsync_jax.checkpoint.processes import (
    ProcessSaveAgreement,
    background_agreement,
    copied_view,
    local_ranks,
    local_view,
    place,
)
from gradsync_jax.checkpoint.staging import STAGING, tensor_bytes
from gradsync_jax.checkpoint.stored import GLOBAL_PARAM, StoredFiles, check_finite
from gradsync_jax.zero.flat import FlatLayout
from gradsync_jax.zero.layout import Layout, ZeroState
from gradsync_jax.zero.model_space import ModelSpace, abstract, model_space, pure
from gradsync_jax.zero.transform import ShardedOptimizer

STEP = "step"  # the canonical key Optax's count is stored under


def _is_count(space: ModelSpace, index: int) -> bool:
    leaf = space.leaves[index]
    return leaf.param is None and leaf.shape == () and leaf.key.rpartition(".")[2] == "count"


def _canonical(space: ModelSpace, modules: Mapping[str, str] | None) -> list[ParamSpec]:
    """The parameters as torch names and shapes them (in the tree's order)."""
    out = []
    for spec in space.specs:
        shape = to_torch_layout(spec.name, np.empty(spec.shape, np.bool_)).shape
        out.append(replace(spec, name=torch_name(spec.name, modules=modules), shape=shape))
    return out


def _counts_as_steps(space: ModelSpace) -> bool:
    """Whether ``count`` maps to torch's per-parameter ``step``: every parameter has state."""
    with_state = {leaf.param for leaf in space.leaves if leaf.param is not None}
    has_count = any(_is_count(space, i) for i in range(len(space.leaves)))
    return has_count and with_state == set(range(len(space.specs)))


@overload
def save_optimizer_state(
    path: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    model: Any = None,
    data: Any = None,
    blocking: Literal[True] = True,
) -> Manifest: ...


@overload
def save_optimizer_state(
    path: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    model: Any = None,
    data: Any = None,
    blocking: Literal[False],
) -> SaveHandle: ...


@overload
def save_optimizer_state(
    path: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    model: Any = None,
    data: Any = None,
    blocking: bool,
) -> Manifest | SaveHandle: ...


@renamed_keywords(directory="path", optimizer="optimizer_name")
def save_optimizer_state(
    path: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    model: Any = None,
    data: Any = None,
    blocking: bool = True,
) -> Manifest | SaveHandle:
    """Write ``state`` to the checkpoint directory ``path``, replacing the checkpoint there
    only once complete.

    Args:
        path: the checkpoint directory.
        tx: the ``shard_optimizer`` that made ``state``.
        state: its state. With several JAX processes every process makes this call; each
            writes the rank files of its own devices (the path must be on a file system all
            of them see) and process 0 writes the manifest once every file is written.
        params: the parameter tree (arrays or ``ShapeDtypeStruct``) the state belongs to.
        step: the training step, stored in the manifest.
        optimizer_name: a name checked on load; default derived from the state's types: the
            canonical name of an optimizer that crosses frameworks (``"adam"``, see
            ``gradsync_jax.checkpoint.optimizers``), else ``"optax:<state types>"``.
        modules: renames of Flax module paths to torch module names (see ``torch_name``),
            e.g. ``{"Dense_0": "layers.0"}``, so the names match the torch model's.
        model: the model weights to store too (usually ``params`` itself; for NNX
            ``nnx.state(model, nnx.Param)``; may hold frozen parameters ``params`` lacks),
            read back with ``load_params`` or ``ZeroRedundancyOptimizer.load(model=)``.
        data: a ``ResumableSampler`` whose position (``state_dict()``) the manifest
            stores as ``extra["data"]``; ``load_optimizer_state(..., data=)`` restores it.
        blocking: ``False``: return once the tensors of this process's rank files are
            copied to host staging memory (allocated at the first such save, reused); the
            files are written, hashed and switched in in a background thread while training
            goes on, the processes agreeing through the distributed key-value store. At most
            one save is in flight: the next save waits for it (docs/checkpoints.md).

    Returns:
        The manifest written; with ``blocking=False`` a ``SaveHandle`` whose ``wait()``
        returns it.

    Raises:
        CheckpointError: on every process, naming the process that failed its part (the
            state does not match ``params``, the path cannot hold a checkpoint, a write
            failed); the previous checkpoint is then kept. A ``ValueError`` and a
            ``RuntimeError`` both; on the failing process the original error is its cause.
            With ``blocking=False``, at ``wait()``, the next save or, unraised, at exit.

    Example:
        >>> save_optimizer_state("ckpt/opt", tx, opt_state, params, step=100)
    """
    position = data_extra(data)
    layout = tx.layout(params)
    complete = isinstance(layout, FlatLayout)  # see gradsync_jax.checkpoint.processes
    # A save in the background copies the state (and the weights) into STAGING as it reads
    # them from the devices, once; the flat partition with several processes gathers them
    # first (a collective, whose result is the save's own already).
    staged = not blocking and not (complete and jax.process_count() > 1)
    local = None
    if not staged:
        local = ZeroState(  # first, so every process takes part in its collective
            inner=local_view(state.inner, complete=complete),
            shards=local_view(dict(state.shards), complete=complete),
        )
    # Each process sees its own devices' shards only; the rank files it writes are exactly
    # those ranks, where this local view is complete (gradsync_jax.checkpoint.processes).
    mine = sorted(local_ranks(tx.mesh, tx.settings.axes))
    n = tx.world_size

    def prepare() -> _Prepared:
        held, weights = local, model
        if held is None:
            trees = (state.inner, dict(state.shards), model)
            take = STAGING.allocator(
                [
                    (tuple(leaf.shape), leaf.dtype)
                    for leaf in jax.tree.leaves(trees)
                    if isinstance(leaf, jax.Array) and leaf.ndim
                ]
            )
            held = ZeroState(
                inner=copied_view(state.inner, take), shards=copied_view(dict(state.shards), take)
            )
            weights = None if model is None else copied_view(model, take)
        return _prepare(
            tx,
            layout,
            held,
            params,
            step,
            optimizer_name,
            modules,
            weights,
            inner=tx.settings.inner,
        )

    return save_rank_files(
        path,
        prepare,
        mine=mine,
        n=n,
        extra=position,
        what=f"cannot save optimizer checkpoint {os.fspath(path)}",
        blocking=blocking,
        staged=staged,
    )


def save_rank_files(
    path: str | os.PathLike[str],
    prepare: Callable[[], _Prepared],
    *,
    mine: Sequence[int],
    n: int,
    extra: Mapping[str, Any],
    what: str,
    blocking: bool = True,
    staged: bool = False,
) -> Manifest | SaveHandle:
    """The save of both JAX savers (ZeRO-1/2 state here, ZeRO-3 in ``param_shards``): this
    process writes the rank files ``mine`` of ``n`` from what ``prepare`` returns, and the
    manifest gains ``extra``; one ``run_save`` agreed across the processes. With
    ``blocking=False`` those files' tensors are copied into ``STAGING`` (unless ``staged``:
    ``prepare`` built them there) and the rest runs in the background (``start_save``,
    agreed by ``background_agreement``)."""

    def write_files(prepared: _Prepared, staging: str) -> dict[int, str]:
        return {
            rank: write_rank_file(staging, rank_file(rank, n), _file_chunks(prepared, rank, n))
            for rank in mine
        }

    steps = SaveSteps(
        prepare=prepare,
        write_files=write_files,
        manifest=lambda prepared, files, _: replace(
            prepared.manifest,
            files={rank_file(r, n): files[r] for r in range(n)},
            extra={**prepared.manifest.extra, **prepared.measured(), **extra},
        ),
    )
    if blocking:
        return run_save(path, ProcessSaveAgreement(), steps, what=what)

    def stage() -> _Prepared:
        prepared = prepare()  # the files of other processes' ranks are not this one's
        return prepared._replace(files=STAGING.stage({r: prepared.files[r] for r in mine}))

    if not staged:
        steps = replace(steps, prepare=stage)
    return start_save(path, background_agreement(), steps, what=what)


class _Prepared(NamedTuple):
    """Every rank file's tensors (exact for the ranks this process writes) and the manifest
    without the files' hashes."""

    files: dict[int, dict[str, np.ndarray]]
    manifest: Manifest
    # What the manifest's extra gains from a measurement that can wait for the write (in the
    # background with ``blocking=False``, not in the call): the hyper-parameters.
    measured: Callable[[], dict[str, Any]] = dict


def _file_chunks(prepared: _Prepared, rank: int, n: int) -> list[Any]:
    """Rank ``rank``'s file, recording its rank and world size (checked on every load)."""
    metadata = {"framework": "jax", **rank_file_metadata(rank, n)}
    return tensor_file(tensor_bytes(prepared.files[rank]), metadata)


class _ModelSpaceState(NamedTuple):
    """The inner state in torch's names, layouts and keys, whole per parameter."""

    full: dict[str, np.ndarray]  # "<param>/<canonical key>" -> whole tensor
    state_keys: dict[str, list[str]]
    scalars: dict[str, Any]
    global_tensors: dict[str, np.ndarray]  # "__optax__/<path>" -> leaf, rank 0's file
    global_keys: list[str]


def _model_space_state(
    space: ModelSpace, values: list[Any], specs: list[ParamSpec]
) -> _ModelSpaceState:
    """Optax's leaves as torch would hold them: per-parameter state under canonical keys;
    ``count`` as every parameter's ``step`` when that is exact; other global leaves apart."""
    steps = _counts_as_steps(space)
    counts = {int(np.asarray(v)) for i, v in enumerate(values) if _is_count(space, i)}
    if len(counts) > 1:  # two counts that disagree cannot be one torch step
        steps = False
    out = _ModelSpaceState({}, {spec.name: [] for spec in specs}, {}, {}, [])
    for i, (leaf, value) in enumerate(zip(space.leaves, values, strict=True)):
        if leaf.param is None:
            if not (steps and _is_count(space, i)):
                out.global_tensors[tensor_key(GLOBAL_PARAM, leaf.key)] = np.array(value, order="C")
                out.global_keys.append(leaf.key)
            continue
        name, key = specs[leaf.param].name, canonical_key(leaf.key)
        out.full[tensor_key(name, key)] = to_torch_layout(space.specs[leaf.param].name, value)
        out.state_keys[name].append(key)
    if steps:  # every parameter has state and there is exactly one count value
        for name, keys in out.state_keys.items():
            keys.append(STEP)
            out.scalars[tensor_key(name, STEP)] = next(iter(counts))
    return out


def _prepare(
    tx: ShardedOptimizer,
    layout: Layout,
    state: ZeroState,
    params: Any,
    step: int,
    optimizer_name: str | None,
    modules: Mapping[str, str] | None,
    model: Any,
    *,
    inner: optax.GradientTransformation,
) -> _Prepared:
    """The tensors of every rank file and the manifest without the files' hashes, from the
    host ``state`` of ``local_view``; ``inner``, the plain Optax transformation, gives the
    hyper-parameters the manifest records for a torch load to compare."""
    space = layout.space
    specs = _canonical(space, modules)
    plan = torch_plan(tx.plan(params), modules=modules)
    held = _model_space_state(space, layout.gather(state), specs)
    files: dict[int, dict[str, np.ndarray]] = {rank: {} for rank in range(tx.world_size)}
    files[0].update(held.global_tensors)
    for shard in plan.shards:
        for key in held.state_keys[shard.name]:
            whole = held.full.get(tensor_key(shard.name, key))
            if whole is None:
                continue
            if plan.kind != "greedy":
                whole = whole.reshape(-1)[shard.start : shard.stop]
            # A view: the write (or a background save's staging) copies it once.
            files[shard.rank][tensor_key(shard.name, key)] = whole
    owners = None
    if model is not None:
        weights, owners = weights_by_rank(model, plan, modules=modules)
        for rank, tensors in weights.items():
            files[rank].update(tensors)
    name = optimizer_name or optimizers.optimizer_name(space.state_types)
    canonical = canonical_optimizer(name)
    count = int(next(iter(held.scalars.values()), int(step)))

    def measured() -> dict[str, Any]:
        # Probes ``inner`` with eager JAX ops (~5-10 ms): run with the manifest, so that a
        # save with blocking=False does not hold the training for it.
        hyperparams = None if canonical is None else measure_hyperparams(inner, canonical, count)
        return {"hyperparams": hyperparams} if hyperparams else {}

    manifest = Manifest(
        framework="jax",
        optimizer=name,
        world_size=tx.world_size,
        step=int(step),
        params=tuple(specs),
        plan=plan,
        state_keys={k: tuple(v) for k, v in held.state_keys.items()},
        files={},
        extra={
            "partition": tx.partition,
            "global_keys": held.global_keys,
            "scalars": held.scalars,
            **({"model": owners} if owners is not None else {}),
        },
    )
    return _Prepared(files, manifest, measured)


def _common_step(manifest: Manifest) -> int | None:
    """The one ``step`` every parameter was saved with (Optax keeps one ``count``)."""
    saved = {k: v for k, v in manifest.extra.get("scalars", {}).items() if k.endswith("/step")}
    if not saved:
        return None
    if len(set(saved.values())) > 1:
        first, *_, last = sorted(saved.items(), key=lambda kv: kv[1])
        raise ValueError(
            f"parameters were stepped a different number of times ({first[0]} = {first[1]}, "
            f"{last[0]} = {last[1]}) but Optax keeps one count; save after a step that "
            "updates every parameter"
        )
    return int(next(iter(saved.values())))


def _needed_keys(
    manifest: Manifest, optimizer: str, space: ModelSpace, param: int
) -> tuple[str, ...]:
    """The canonical keys this Optax state keeps for parameter ``param``: its own, since a
    partition or a mask gives parameters different state (``optax.contrib.muon``: the
    matrices Muon's momentum, the rest Adam's moments)."""
    if manifest.framework == "torch":
        return counterpart_keys(manifest.optimizer, optimizer) or ()
    keys = {canonical_key(leaf.key) for leaf in space.leaves if leaf.param == param}
    return tuple(sorted(keys | ({STEP} if _counts_as_steps(space) else set())))


@renamed_keywords(directory="path", optimizer="optimizer_name")
def load_optimizer_state(
    path: str | os.PathLike[str],
    tx: optax.GradientTransformation,
    params: Any,
    *,
    optimizer_name: str | None = None,
    modules: Mapping[str, str] | None = None,
    data: Any = None,
    allow_nonfinite: bool = False,
) -> tuple[Any, Manifest]:
    """Read a checkpoint into a new state for ``tx``, whether ``gradsync_jax`` or
    ``gradsync_torch`` wrote it: a ``shard_optimizer`` (any device count, either partition)
    or a plain Optax transformation (``optax.adamw(...)``: the state ``tx.init`` would make).

    Every file is checked against its manifest hash and every tensor against the expected
    shape and dtype before anything is placed on a device; on any error nothing changes
    (the state is a new value: keep using the old one). A torch checkpoint loads when its
    optimizer is the counterpart of ``tx``'s inner one (``gradsync_core.COUNTERPARTS``:
    ``torch.optim.AdamW`` and ``optax.adamw`` are both ``adamw``, ...).

    Args:
        path: a checkpoint written by ``save_optimizer_state`` or by
            ``gradsync_torch.ZeroRedundancyOptimizer.save``.
        tx: the ``shard_optimizer`` to load into (its mesh may differ from the saver's), or
            a plain Optax transformation.
        params: the parameter tree (arrays or ``ShapeDtypeStruct``).
        optimizer_name: the name given at save time, if one was.
        modules: the Flax-to-torch module renames given at save time (see ``torch_name``).
        data: a ``ResumableSampler`` to position where the checkpoint's data was
            (``extra["data"]``, saved by either framework with ``data=``); positioned only
            once everything else checked out.
        allow_nonfinite: take NaN or inf in state tensors as they are (say, to look at a
            diverged run); by default they are refused, like a tensor of another shape or
            dtype (never cast), a ``step`` below 0 or a non-finite hyper-parameter.

    Returns:
        ``(state, manifest)``; for a ``shard_optimizer`` the state is placed with
        ``tx.state_shardings(params)``, for a plain transformation its leaves are host
        (NumPy) arrays in the tree ``tx.init(params)`` returns.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different.

    Example:
        >>> opt_state, manifest = load_optimizer_state("ckpt/opt", tx, params)
    """
    shown = os.fspath(path)
    directory = resolve_checkpoint(path)  # one version, even while a save switches it
    layout: Layout | None
    if isinstance(tx, ShardedOptimizer):
        layout = tx.layout(params)
        space = layout.space
    else:  # a plain Optax transformation: its whole state, unsharded
        layout, space = None, model_space(tx, abstract(pure(params)))
    optimizer = optimizer_name or optimizers.optimizer_name(space.state_types)
    with reading_version(directory):  # a later save that removes it: a sentence, load again
        manifest = read_manifest(directory)
        names = _check_loadable(directory, manifest, space, optimizer, modules)
        with StoredFiles(directory, manifest) as stored:
            shapes = stored.state()
            _state_values(manifest, space, names, shapes)  # every check, before any read
            tensors = stored.read_state(shapes)
    values = _state_values(manifest, space, names, tensors)
    if not allow_nonfinite:
        check_finite(tensors)
    _warn_hyperparams(shown, manifest, tx, optimizer)
    restore_data(manifest.extra, data, os.fspath(directory))  # the load can no longer fail
    if layout is None:
        return space.state_treedef.unflatten(values), manifest
    assert isinstance(tx, ShardedOptimizer)
    if jax.process_count() == 1:
        state = tx.scatter_state(space.state_treedef.unflatten(values), params)
    else:  # every process read every state tensor; each fills its own devices' shards
        state = place(layout.scatter(values), tx.state_shardings(params))
    return state, manifest


def _warn_hyperparams(
    shown: str, manifest: Manifest, tx: optax.GradientTransformation, optimizer: str
) -> None:
    """Warn (``HyperparameterWarning``) naming each hyper-parameter of a torch checkpoint
    that ``tx``'s Optax transformation does not compute with: it keeps its own."""
    canonical = canonical_optimizer(optimizer)
    if manifest.framework != "torch" or manifest.version < 2 or canonical is None:
        return
    saved = manifest.extra.get("param_groups", [])
    inner = tx.settings.inner if isinstance(tx, ShardedOptimizer) else tx
    eps = saved[0].get("eps", 1e-8) if saved else 1e-8
    here = measure_hyperparams(inner, canonical, _common_step(manifest) or 0, eps)
    if here is None:
        return
    keeps = "Optax keeps the hyper-parameters in the transformation, which a load cannot change"
    message = hyperparameter_warning(
        shown, manifest.optimizer, saved, [here], canonical, keeps=keeps
    )
    if message:
        warnings.warn(message, HyperparameterWarning, stacklevel=3)


def _check_loadable(
    directory: str | os.PathLike[str],
    manifest: Manifest,
    space: ModelSpace,
    optimizer: str,
    modules: Mapping[str, str] | None,
) -> list[str]:
    """Refuse another model, optimizer or state keys; the parameters' checkpoint names."""
    if manifest.version == 1:
        if manifest.framework != "jax":
            raise ValueError(
                f"{directory!s} was written by gradsync_torch in format version 1, which only "
                "gradsync_torch reads; load it there (ZeroRedundancyOptimizer.load) and save "
                "it again to get version 2, which JAX reads"
            )
        check_compatible(manifest, space.specs, optimizer=optimizer)
        return [spec.name for spec in space.specs]  # version 1: Flax names, layouts, keys
    specs = _canonical(space, modules)
    check_compatible(manifest, specs, optimizer=optimizer, framework="jax")
    for i, spec in enumerate(specs):
        saved = manifest.state_keys.get(spec.name, ())
        needed = _needed_keys(manifest, optimizer, space, i)
        check_state_keys(manifest.optimizer, optimizer, spec.name, saved, needed)
    return [spec.name for spec in specs]


def _state_key(manifest: Manifest, space: ModelSpace, names: list[str], index: int) -> str:
    """The checkpoint key of the inner state's leaf ``index``."""
    leaf = space.leaves[index]
    if leaf.param is None:
        return tensor_key(GLOBAL_PARAM, leaf.key)
    if manifest.version == 1:
        return tensor_key(names[leaf.param], leaf.key)
    return tensor_key(names[leaf.param], canonical_key(leaf.key))


def _state_values(
    manifest: Manifest, space: ModelSpace, names: list[str], tensors: dict[str, np.ndarray]
) -> list[Any]:
    """The inner state's leaves from the checkpoint's tensors, each checked for its shape
    and dtype, in the state's flattening order."""
    step = _common_step(manifest) if manifest.version >= 2 else None
    values, expected = [], set()
    for i, leaf in enumerate(space.leaves):
        if leaf.param is None and step is not None and _is_count(space, i):
            values.append(np.asarray(step, dtype=leaf.dtype))
            continue
        key = _state_key(manifest, space, names, i)
        expected.add(key)
        if key not in tensors:
            raise ValueError(
                f"checkpoint has no tensor {key!r}: it was saved from another optimizer "
                "configuration"
            )
        value = tensors[key]
        if leaf.param is not None and manifest.version >= 2:
            value = from_torch_layout(space.specs[leaf.param].name, value)
        if tuple(value.shape) != leaf.shape or value.dtype != np.dtype(leaf.dtype):
            raise ValueError(
                f"checkpoint tensor {key!r} is {tuple(value.shape)} {value.dtype}, expected "
                f"{leaf.shape} {leaf.dtype}"
            )
        values.append(value)
    unexpected = sorted(set(tensors) - expected)
    if unexpected:
        raise ValueError(
            f"checkpoint holds {len(unexpected)} tensor(s) this optimizer does not have, "
            f"starting with {unexpected[0]!r}"
        )
    return values
