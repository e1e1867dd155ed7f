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
own devices' rank files and process 0 the manifest (``gradsync_jax.zero.processes``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import jax
import numpy as np
import optax
from safetensors.numpy import save as save_bytes

from gradsync_core import (
    Manifest,
    ParamSpec,
    begin_save,
    canonical_state_key,
    check_compatible,
    check_state_keys,
    commit_save,
    counterpart_keys,
    discard_save,
    new_save_token,
    rank_file,
    read_manifest,
    sha256_file,
    staging_directory,
    tensor_key,
    write_atomic,
    write_manifest,
)
from gradsync_jax._naming import from_torch_layout, to_torch_layout, torch_name, torch_plan
from gradsync_jax.model_state import weights_by_rank
from gradsync_jax.zero.flat import FlatLayout
from gradsync_jax.zero.layout import Layout, ZeroState
from gradsync_jax.zero.model_space import ModelSpace, abstract, model_space, pure
from gradsync_jax.zero.processes import SaveAgreement, local_ranks, local_view, place
from gradsync_jax.zero.stored import GLOBAL_PARAM, assemble, read_rank_files
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


def save_optimizer_state(
    directory: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer: str | None = None,
    modules: Mapping[str, str] | None = None,
    model: Any = None,
) -> Manifest:
    """Write ``state`` to ``directory``, replacing the checkpoint there only once complete.

    Args:
        directory: the checkpoint directory.
        tx: the ``shard_optimizer`` that made ``state``.
        state: its state. With several JAX processes every process makes this call; each
            writes the rank files of its own devices (the path must be on a file system all
            of them see) and process 0 writes the manifest once every file is written.
        params: the parameter tree (arrays or ``ShapeDtypeStruct``) the state belongs to.
        step: the training step, stored in the manifest.
        optimizer: a name checked on load; default derived from the state's types
            (``"optax:ScaleByAdamState,EmptyState"``).
        modules: renames of Flax module paths to torch module names (see ``torch_name``),
            e.g. ``{"Dense_0": "layers.0"}``, so the names match the torch model's.
        model: the model weights to store too (usually ``params`` itself; for NNX
            ``nnx.state(model, nnx.Param)``; may hold frozen parameters ``params`` lacks),
            read back with ``load_params`` or ``ZeroRedundancyOptimizer.load(model=)``.

    Returns:
        The manifest written.

    Raises:
        ValueError: if the state does not match ``params`` or the path cannot hold a
            checkpoint.
        RuntimeError: on every other process, when one process failed its part (the
            previous checkpoint is then kept).

    Example:
        >>> save_optimizer_state("ckpt/opt", tx, opt_state, params, step=100)
    """
    layout = tx.layout(params)
    # Each process sees its own devices' shards only; the rank files it writes are exactly
    # those ranks, where this local view is complete (gradsync_jax.zero.processes).
    mine = local_ranks(tx.mesh, tx.settings.axes)
    agreement = SaveAgreement()
    complete = isinstance(layout, FlatLayout)  # see gradsync_jax.zero.processes
    local = ZeroState(  # first, so every process takes part in its collective
        inner=local_view(state.inner, complete=complete),
        shards=local_view(dict(state.shards), complete=complete),
    )
    error: Exception | None = None
    try:
        files, manifest = _prepare(tx, layout, local, params, step, optimizer, modules, model)
    except Exception as err:  # held until every process knows
        error = err
    agreement.all_ok(error is None, "preparing its checkpoint files")
    if error is not None:
        raise error
    n = tx.world_size
    token = None
    if agreement.leader:
        try:
            token = new_save_token()
            begin_save(directory, token)
        except Exception as err:
            error = err
    agreement.all_ok(error is None, "opening the checkpoint's staging directory")
    if error is not None:
        raise error
    # Everything goes to a staging directory; the switch at the end is the only change a
    # reader of ``directory`` can see, so a save cut short leaves the previous one (§9).
    staging = staging_directory(directory, agreement.share_token(token))
    digests: dict[int, str] = {}
    try:
        for rank in sorted(mine):
            path = os.path.join(staging, rank_file(rank, n))
            write_atomic(path, save_bytes(files[rank], metadata={"framework": "jax"}))
            digests[rank] = sha256_file(path)
    except Exception as err:
        error = err
    try:
        agreement.all_ok(error is None, "writing its rank files")
        if error is not None:
            raise error
        hashes = agreement.gather_digests(digests, n)
    except BaseException:
        if agreement.leader:
            discard_save(staging)
        raise
    manifest = replace(manifest, files={rank_file(r, n): hashes[r] for r in range(n)})
    if agreement.leader:
        try:
            write_manifest(staging, manifest)
            commit_save(directory, staging)
        except Exception as err:
            error = err
            discard_save(staging)
    agreement.all_ok(error is None, "writing the manifest and switching the checkpoint")
    if error is not None:
        raise error
    return manifest


def _prepare(
    tx: ShardedOptimizer,
    layout: Layout,
    state: ZeroState,
    params: Any,
    step: int,
    optimizer: str | None,
    modules: Mapping[str, str] | None,
    model: Any,
) -> tuple[dict[int, dict[str, np.ndarray]], Manifest]:
    """The tensors of every rank file (exact for the ranks this process writes) and the
    manifest without the files' hashes, from the host ``state`` of ``local_view``."""
    space = layout.space
    values = layout.gather(state)
    specs = _canonical(space, modules)
    plan = torch_plan(tx.plan(params), modules=modules)
    steps = _counts_as_steps(space)
    counts = {int(np.asarray(v)) for i, v in enumerate(values) if _is_count(space, i)}
    if len(counts) > 1:  # two counts that disagree cannot be one torch step
        steps = False
    n = tx.world_size
    full: dict[str, np.ndarray] = {}
    state_keys: dict[str, list[str]] = {spec.name: [] for spec in specs}
    scalars: dict[str, Any] = {}
    files: dict[int, dict[str, np.ndarray]] = {rank: {} for rank in range(n)}
    global_keys = []
    for i, (leaf, value) in enumerate(zip(space.leaves, values, strict=True)):
        if leaf.param is None:
            if not (steps and _is_count(space, i)):
                files[0][tensor_key(GLOBAL_PARAM, leaf.key)] = np.array(value, order="C")
                global_keys.append(leaf.key)
            continue
        name, key = specs[leaf.param].name, canonical_state_key("jax", leaf.key)
        full[tensor_key(name, key)] = to_torch_layout(space.specs[leaf.param].name, value)
        state_keys[name].append(key)
    if steps:  # every parameter has state and there is exactly one count value
        for name, keys in state_keys.items():
            keys.append(STEP)
            scalars[tensor_key(name, STEP)] = next(iter(counts))
    for shard in plan.shards:
        for key in state_keys[shard.name]:
            whole = full.get(tensor_key(shard.name, key))
            if whole is None:
                continue
            if plan.kind != "greedy":
                whole = whole.reshape(-1)[shard.start : shard.stop]
            files[shard.rank][tensor_key(shard.name, key)] = np.array(whole, order="C")
    owners = None
    if model is not None:
        weights, owners = weights_by_rank(model, plan, modules=modules)
        for rank, tensors in weights.items():
            files[rank].update(tensors)
    manifest = Manifest(
        framework="jax",
        optimizer=optimizer or space.optimizer,
        world_size=n,
        step=int(step),
        params=tuple(specs),
        plan=plan,
        state_keys={k: tuple(v) for k, v in state_keys.items()},
        files={},
        extra={
            "partition": tx.partition,
            "global_keys": global_keys,
            "scalars": scalars,
            **({"model": owners} if owners is not None else {}),
        },
    )
    return files, manifest


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


def _needed_keys(manifest: Manifest, optimizer: str, space: ModelSpace) -> tuple[str, ...]:
    """The canonical per-parameter keys this Optax state keeps."""
    if manifest.framework == "torch":
        return counterpart_keys(manifest.optimizer, optimizer) or ()
    keys = {canonical_state_key("jax", leaf.key) for leaf in space.leaves if leaf.param is not None}
    return tuple(sorted(keys | ({STEP} if _counts_as_steps(space) else set())))


def load_optimizer_state(
    directory: str | os.PathLike[str],
    tx: optax.GradientTransformation,
    params: Any,
    *,
    optimizer: str | None = None,
    modules: Mapping[str, str] | None = None,
) -> tuple[Any, Manifest]:
    """Read a checkpoint into a new state for ``tx``, whether ``gradsync_jax`` or
    ``gradsync_torch`` wrote it: a ``shard_optimizer`` (any device count, either partition)
    or a plain Optax transformation (``optax.adamw(...)``: the state ``tx.init`` would make).

    Every file is checked against its manifest hash and every tensor against the expected
    shape and dtype before anything is placed on a device; on any error nothing changes
    (the state is a new value: keep using the old one). A torch checkpoint loads when its
    optimizer is the counterpart of ``tx``'s inner one (``gradsync_core.COUNTERPARTS``:
    ``torch.optim.AdamW`` and ``optax.adamw``, ...).

    Args:
        directory: a checkpoint written by ``save_optimizer_state`` or by
            ``gradsync_torch.ZeroRedundancyOptimizer.save``.
        tx: the ``shard_optimizer`` to load into (its mesh may differ from the saver's), or
            a plain Optax transformation.
        params: the parameter tree (arrays or ``ShapeDtypeStruct``).
        optimizer: the name given at save time, if one was.
        modules: the Flax-to-torch module renames given at save time (see ``torch_name``).

    Returns:
        ``(state, manifest)``; for a ``shard_optimizer`` the state is placed with
        ``tx.state_shardings(params)``, for a plain transformation its leaves are host
        (NumPy) arrays in the tree ``tx.init(params)`` returns.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different.

    Example:
        >>> opt_state, manifest = load_optimizer_state("ckpt/opt", tx, params)
    """
    manifest = read_manifest(directory)
    if isinstance(tx, ShardedOptimizer):
        layout: Layout | None = tx.layout(params)
        space = layout.space
    else:  # a plain Optax transformation: its whole state, unsharded
        layout, space = None, model_space(tx, abstract(pure(params)))
    optimizer = optimizer or space.optimizer
    if manifest.version == 1:
        if manifest.framework != "jax":
            raise ValueError(
                f"{directory!s} was written by gradsync_torch in format version 1, which only "
                "gradsync_torch reads; load it there (ZeroRedundancyOptimizer.load) and save "
                "it again to get version 2, which JAX reads"
            )
        names = [spec.name for spec in space.specs]  # version 1: Flax names, layouts, keys
        check_compatible(manifest, space.specs, optimizer=optimizer)
    else:
        specs = _canonical(space, modules)
        names = [spec.name for spec in specs]
        check_compatible(manifest, specs, optimizer=optimizer, framework="jax")
        needed = _needed_keys(manifest, optimizer, space)
        for name in names:
            saved = manifest.state_keys.get(name, ())
            check_state_keys(manifest.optimizer, optimizer, name, saved, needed)
    tensors = assemble(manifest, read_rank_files(directory, manifest))
    step = _common_step(manifest) if manifest.version >= 2 else None
    values, expected = [], set()
    for i, leaf in enumerate(space.leaves):
        if leaf.param is None and step is not None and _is_count(space, i):
            values.append(np.asarray(step, dtype=leaf.dtype))
            continue
        if leaf.param is None:
            key = tensor_key(GLOBAL_PARAM, leaf.key)
        elif manifest.version == 1:
            key = tensor_key(names[leaf.param], leaf.key)
        else:
            key = tensor_key(names[leaf.param], canonical_state_key("jax", leaf.key))
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
    if layout is None:
        return space.state_treedef.unflatten(values), manifest
    assert isinstance(tx, ShardedOptimizer)
    if jax.process_count() == 1:
        state = tx.scatter_state(space.state_treedef.unflatten(values), params)
    else:  # every process read every file; each fills its own devices' shards
        state = place(layout.scatter(values), tx.state_shardings(params))
    return state, manifest
