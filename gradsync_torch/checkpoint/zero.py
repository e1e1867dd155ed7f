"""Resharding checkpoints for ``ZeroRedundancyOptimizer`` (docs/design.md §9).

The format is gradsync_core's (version 2, read by gradsync_jax too): one safetensors file per
rank holding ``"<param name>/<state key>"`` tensors in model space and a ``manifest.json``
written last by rank 0. A ZeRO-1 (greedy) rank file holds whole state tensors; a ZeRO-2 (flat)
one the 1-D slice ``[start, stop)`` of the flattened state that rank's shard names. 0-d state
(Adam's ``step``) goes to ``extra["scalars"]`` as JSON numbers; hyper-parameters to
``extra["param_groups"]``.

Loading at any world size re-plans: each rank assembles only the parameters it now owns
from the files holding them. Every rank validates before any rank changes state, and the
ranks agree on the outcome, so a failed load leaves every optimizer untouched. The functions
here take what they need and return values; the optimizer applies a ``Loaded`` itself.
"""

from __future__ import annotations

import itertools
import math
import os
import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import torch
from safetensors import safe_open
from torch import nn

from gradsync_core import (
    HyperparameterWarning,
    Manifest,
    ParamSpec,
    ShardPlan,
    read_manifest,
)
from gradsync_core.checkpoint import (
    LAYOUT,
    MANIFEST,
    SaveHandle,
    SaveSteps,
    Window,
    WindowRead,
    canonical_optimizer,
    check_compatible,
    error_message,
    hyperparameter_warning,
    model_owners,
    rank_file,
    rank_file_metadata,
    reading_version,
    resolve_checkpoint,
    run_save,
    start_save,
    state_reads,
    tensor_file,
    tensor_key,
    verify_file_hashes,
    write_rank_file,
    write_staged_rank_file,
)
from gradsync_torch._optim_state import RankGroup, StatePiece, assemble, optimizer_name
from gradsync_torch.checkpoint.json_values import from_json, groups_json, to_json
from gradsync_torch.checkpoint.model_state import (
    check_weights,
    model_weights,
    rank_weights,
    read_weights,
    weight_files,
)
from gradsync_torch.checkpoint.save_agreement import RankSaveAgreement, background_ranks
from gradsync_torch.checkpoint.saved_keys import check_other_framework_keys, check_torch_keys
from gradsync_torch.checkpoint.staging import STAGING, tensor_bytes
from gradsync_torch.checkpoint.state_values import (
    ValuePolicy,
    check_finite_weights,
    check_slice_lengths,
    check_state_values,
)


class Snapshot(NamedTuple):
    """What ``save`` writes: one rank's view of the optimizer."""

    optimizer: str  # e.g. "torch.optim.Adam"
    step: int
    shard_gradients: bool
    names: list[str]  # one per parameter, global index order
    specs: list[ParamSpec]
    plan: ShardPlan
    param_groups: list[dict[str, Any]]
    pieces: list[StatePiece]  # this rank's state
    model: nn.Module | None = None  # its weights are stored too (every rank has a copy)
    data: dict[str, Any] | None = None  # the manifest's data position (``data_extra``)
    # The model's weights this rank writes, when its parameters are sharded (ZeRO-3 gathers
    # each before the save); None: every rank has a copy, taken from ``model``.
    weights: dict[str, torch.Tensor] | None = None
    # The rank that writes each weight when there is no ``model`` (a save across layouts: no
    # rank has the whole model); ``weights`` then holds the ones this rank owns.
    weight_owners: dict[str, int] | None = None
    layout: dict[str, Any] | None = None  # the manifest's extra["layout"] (layout_record)


class LoadTarget(NamedTuple):
    """The optimizer a checkpoint is loaded into, as ``load`` needs to check and slice."""

    optimizer_class: type[torch.optim.Optimizer]  # its name and the state keys it keeps
    names: list[str]
    specs: list[ParamSpec]
    param_groups: list[dict[str, Any]]
    shapes: list[tuple[int, ...]]
    needed: set[int]  # global indices of the parameters this rank's layout steps
    model: nn.Module | None = None  # receives the stored weights, if the checkpoint has any
    policy: ValuePolicy = ValuePolicy()  # non-finite values and dtype casts: refused by default
    # The element range [start, stop) of each parameter this rank keeps, row-aligned (ZeRO-3:
    # its rows); only that part of the state is read, and ``Loaded.state`` holds those rows.
    # None: whole parameters.
    windows: dict[int, tuple[int, int]] | None = None

    @property
    def optimizer(self) -> str:
        return optimizer_name(self.optimizer_class)


class Loaded(NamedTuple):
    """What a checkpoint gives the optimizer: its step, this rank's state, its groups."""

    step: int
    state: dict[int, dict[str, Any]]  # model-space state by global index
    param_groups: list[dict[str, Any]]  # saved hyper-parameters with the current params
    model: dict[str, torch.Tensor] | None = None  # checked weights for ``LoadTarget.model``
    extra: dict[str, Any] | None = None  # the manifest's extra (its data position)
    # A checkpoint of the other framework saved with other hyper-parameters than the groups
    # kept here: the ``HyperparameterWarning`` given once the load is agreed.
    hyper_warning: str | None = None


class _Prepared(NamedTuple):
    """This rank's part of a save, built before anything on disk changes; values only (a
    save in the background builds its manifest from it while training changes the rest)."""

    tensors: dict[str, torch.Tensor]
    record: dict[str, Any]  # what the manifest needs from this rank: state keys, scalars
    groups: list[dict[str, Any]]  # the param groups as JSON
    owners: dict[str, int] | None  # the stored weights' ranks (None: no weights)


def _rank_state(
    pieces: Sequence[StatePiece],
    names: Sequence[str],
    plan: ShardPlan,
    rank: int,
    *,
    to_host: bool = True,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, list[str]]]:
    """This rank's tensors, 0-d state as JSON numbers (as gradsync_jax stores Optax's count)
    and state keys, by checkpoint name. Every trainable parameter this rank owns gets a
    ``state_keys`` entry, empty when it has no state yet (it never received a gradient).
    ``to_host=False`` leaves the tensors where they are, for ``STAGING.stage`` to copy."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    state_keys: dict[str, list[str]] = {s.name: [] for s in plan.shards if s.rank == rank}
    for piece in pieces:
        name, keys = names[piece.index], []
        for key, value in piece.state.items():
            if value is None:
                continue
            if torch.is_tensor(value) and value.dim() >= 1:
                value = value.detach()
                tensors[tensor_key(name, key)] = value.cpu().contiguous() if to_host else value
            else:
                scalars[tensor_key(name, key)] = to_json(value, f"state {key!r} of {name!r}")
            keys.append(key)
        state_keys[name] = keys
    return tensors, scalars, state_keys


def weight_owners_of(snapshot: Snapshot) -> dict[str, int]:
    """The rank whose file holds each of the snapshot's model weights (``model_owners``)."""
    if snapshot.weight_owners is not None:
        return dict(snapshot.weight_owners)
    names = [] if snapshot.model is None else [n for n, _ in snapshot.model.named_parameters()]
    return model_owners(snapshot.plan, names)


def _prepare(snapshot: Snapshot, rank: int, *, to_host: bool = True) -> _Prepared:
    """This rank's tensors and record; ``to_host=False``: the tensors left on their device
    (a GPU's included) for the staging copy, the one copy to the host a background save
    makes (copying each to the CPU first took 0.11 of 0.19 s per 288 MiB save on a GPU)."""
    groups = groups_json(snapshot.param_groups, snapshot.names)
    tensors, scalars, state_keys = _rank_state(
        snapshot.pieces, snapshot.names, snapshot.plan, rank, to_host=to_host
    )
    owners = None
    if snapshot.model is not None or snapshot.weight_owners is not None:
        owners = weight_owners_of(snapshot)
        weights = snapshot.weights
        if weights is None:
            assert snapshot.model is not None
            mine = {name for name, owner in owners.items() if owner == rank}
            weights = model_weights(snapshot.model, mine, to_host=to_host)
        tensors.update(rank_weights(weights, owners, rank))
    return _Prepared(tensors, {"state_keys": state_keys, "scalars": scalars}, groups, owners)


def _write_files(prepared: _Prepared, staging: str, ranks: RankGroup) -> dict[int, str]:
    metadata = rank_file_metadata(ranks.rank, ranks.world_size)
    chunks = tensor_file(tensor_bytes(prepared.tensors), metadata)
    name = rank_file(ranks.rank, ranks.world_size)
    return {ranks.rank: write_rank_file(staging, name, chunks)}


def _write_staged(prepared: _Prepared, staging: str, ranks: RankGroup) -> dict[int, str]:
    """``_write_files`` for tensors in ``STAGING``: the writer process writes the file."""
    metadata = rank_file_metadata(ranks.rank, ranks.world_size)
    name = rank_file(ranks.rank, ranks.world_size)
    places = STAGING.places(prepared.tensors)
    return {ranks.rank: write_staged_rank_file(STAGING.memory, staging, name, places, metadata)}


def _manifest(
    snapshot: Snapshot, prepared: _Prepared, files: dict[int, str], records: list[Any]
) -> Manifest:
    all_keys: dict[str, tuple[str, ...]] = {}
    all_scalars: dict[str, Any] = {}
    for record in records:
        for name, keys in record["state_keys"].items():
            # Under ZeRO-2 a parameter spans ranks; one that has no state yet on one rank
            # must not hide the keys another rank saved.
            if keys or name not in all_keys:
                all_keys[name] = tuple(keys)
        all_scalars.update(record["scalars"])
    world_size = len(records)
    return Manifest(
        framework="torch",
        optimizer=snapshot.optimizer,
        world_size=world_size,
        step=snapshot.step,
        params=tuple(snapshot.specs),
        plan=snapshot.plan,
        state_keys=dict(sorted(all_keys.items())),
        files={rank_file(r, world_size): files[r] for r in range(world_size)},
        extra={
            "param_groups": prepared.groups,
            "scalars": all_scalars,
            "shard_gradients": snapshot.shard_gradients,
            **({"model": prepared.owners} if prepared.owners is not None else {}),
            **(snapshot.data or {}),
            **({LAYOUT: snapshot.layout} if snapshot.layout is not None else {}),
        },
    )


def save(
    path: str | os.PathLike[str],
    snapshot: Snapshot,
    ranks: RankGroup,
    *,
    blocking: bool = True,
    what: str | None = None,
) -> SaveHandle | None:
    """Write ``snapshot`` to directory ``path`` (a collective over ``ranks``).

    Every rank writes its file into a staging directory beside ``path``; rank 0 writes the
    manifest last, then switches ``path`` to it atomically (``gradsync_core.checkpoint.
    run_save``, docs/design.md §9). A failure on any rank (a full disk, a bad state value)
    raises on every rank; ``path`` keeps its data. With ``blocking=False`` this rank's
    tensors are copied into ``STAGING`` and the rest runs in the background
    (``gradsync_core.checkpoint.start_save``), agreed over ``background_ranks``, the rank
    file written from ``STAGING`` by the writer process (``write_staged_rank_file``).

    Returns:
        ``None``; with ``blocking=False`` the save's ``SaveHandle``.

    Raises:
        CheckpointError: on any rank's failure, naming the rank (a ``ValueError``); with
            ``blocking=False``, at the handle's ``wait()`` or the next save instead.
    """
    what = what or f"cannot save optimizer checkpoint {os.fspath(path)}"
    steps = SaveSteps(
        prepare=lambda: _prepare(snapshot, ranks.rank),
        write_files=lambda prepared, staging: _write_files(prepared, staging, ranks),
        record=lambda prepared: prepared.record,
        manifest=lambda prepared, files, records: _manifest(snapshot, prepared, files, records),
    )
    if blocking:
        run_save(path, RankSaveAgreement(ranks), steps, what=what)
        return None
    background = background_ranks(ranks)

    def stage() -> _Prepared:
        prepared = _prepare(snapshot, ranks.rank, to_host=False)
        return prepared._replace(tensors=STAGING.stage(prepared.tensors))

    staged = replace(
        steps,
        prepare=stage,
        write_files=lambda prepared, staging: _write_staged(prepared, staging, ranks),
    )
    return start_save(path, RankSaveAgreement(background), staged, what=what)


def _check_manifest(path: str, target: LoadTarget) -> Manifest:
    """Read the manifest and refuse another model, optimizer or param groups."""
    manifest = read_manifest(path, verify_files=False)
    check_compatible(manifest, target.specs, optimizer=target.optimizer, framework="torch")
    expected = {rank_file(r, manifest.world_size) for r in range(manifest.world_size)}
    if set(manifest.files) != expected:
        raise ValueError(f"{path}/{MANIFEST} does not list one file per saved rank")
    if manifest.framework != "torch":
        # Optax keeps hyper-parameters in the transformation, not the state: the optimizer's
        # own param groups stay as built.
        check_other_framework_keys(path, manifest, target.optimizer)
        return manifest
    bounds = [0]
    for group in target.param_groups:
        bounds.append(bounds[-1] + len(group["params"]))
    mine = [target.names[a:b] for a, b in itertools.pairwise(bounds)]
    theirs = [list(g.get("params", [])) for g in manifest.extra.get("param_groups", [])]
    if mine != theirs:
        raise ValueError(
            f"param groups differ: {len(theirs)} group(s) of {[len(g) for g in theirs]} "
            f"parameters in the checkpoint, {len(mine)} of {[len(g) for g in mine]} here; "
            "build the optimizer with the same param groups before loading"
        )
    check_torch_keys(manifest, target.optimizer, target.optimizer_class, target.param_groups)
    return manifest


def _reads(manifest: Manifest, target: LoadTarget) -> list[WindowRead]:
    """What this rank reads (``gradsync_core.checkpoint.state_reads``): of each parameter with
    state that its layout steps, its window (``target.windows``, ZeRO-3's rows) or the whole
    parameter; an empty window reads an empty piece of its first shard, which carries its keys
    and dtypes."""
    windows, keys = [], {}
    for index in sorted(target.needed):
        name = target.names[index]
        if name not in manifest.state_keys:
            continue
        whole = (0, math.prod(target.shapes[index]))
        first, last = whole if target.windows is None else target.windows[index]
        windows.append(Window(name=name, start=first, stop=last))
        keys[name] = manifest.state_keys[name]
    return list(state_reads(manifest.plan, windows, keys))


def _kept_shapes(target: LoadTarget) -> list[tuple[int, ...]]:
    """The shape of each parameter's state this rank keeps: the parameter's, or the rows of
    its window (``target.windows``, row-aligned)."""
    if target.windows is None:
        return list(target.shapes)
    out = []
    for index, shape in enumerate(target.shapes):
        first, last = target.windows.get(index, (0, 0))
        row = math.prod(shape[1:]) or 1
        out.append(((last - first) // row, *shape[1:]))
    return out


def _window_part(view: Any, read: WindowRead, whole: bool, shape: tuple[int, ...]) -> torch.Tensor:
    """Elements ``[read.start, read.stop)`` of a stored tensor, read from the file as a slice
    (never the whole tensor): rows of a whole one (windows are row-aligned), a range of a
    flat one."""
    if read.start == read.stop:  # an empty window: no elements, the stored dtype
        return view[0:0].reshape(-1)
    if whole:
        row = math.prod(shape[1:]) or 1
        return view[read.start // row : read.stop // row].reshape(-1)
    return view[read.start : read.stop]


def _read_pieces(
    path: str, manifest: Manifest, reads: Sequence[WindowRead], target: LoadTarget
) -> list[StatePiece]:
    """The state of ``reads`` from their rank files, as pieces in the current indices (with
    windows: flat pieces at offsets inside the window)."""
    index_of = {name: i for i, name in enumerate(target.names)}
    scalars = manifest.extra.get("scalars", {})
    whole = manifest.plan.kind == "greedy"
    handles = {f: safe_open(os.path.join(path, f), framework="pt") for f in {r.file for r in reads}}
    pieces = []
    for read in reads:
        name = read.window.name
        index, handle = index_of[name], handles[read.file]
        state: dict[str, Any] = {}
        for key, full_key in zip(manifest.state_keys[name], read.keys, strict=True):
            if full_key in scalars:
                state[key] = scalars[full_key]
            elif target.windows is not None:
                part = handle.get_slice(full_key)
                state[key] = _window_part(part, read, whole, target.shapes[index])
            else:
                # A whole tensor would be kept as it is, backed by the file's memory map for
                # the optimizer's life (pinning the file's disk space after a later save
                # deletes it): copy it out. Flat slices are copied when joined.
                tensor = handle.get_tensor(full_key)
                state[key] = tensor.clone() if whole else tensor
        # Whole parameters: pieces at the shards' own offsets (greedy: whole tensors); with
        # windows (ZeRO-3's rows): flat pieces at offsets inside the window.
        pieces.append(
            StatePiece(
                index, read.at, read.at + read.numel, whole and target.windows is None, state
            )
        )
    return pieces


def _read(path: str, target: LoadTarget, ranks: RankGroup, shown: str) -> Loaded:
    """Validate the checkpoint version ``path`` (``shown``: the path the user gave) and read
    this rank's state; touches nothing. A version a later save removes meanwhile is refused
    with the sentence of ``reading_version``."""
    with reading_version(path):
        return _read_version(path, target, ranks, shown)


def _read_version(path: str, target: LoadTarget, ranks: RankGroup, shown: str) -> Loaded:
    manifest = _check_manifest(path, target)
    reads = _reads(manifest, target)
    # Every file is hashed by some rank (and every file a rank reads, by that rank), so a
    # corrupt file fails the load everywhere even when nobody needs its tensors.
    to_read = {r.file for r in reads}
    with_weights = target.model is not None and bool(manifest.extra.get("model"))
    if with_weights:
        to_read |= weight_files(manifest)
    spread = {f for i, f in enumerate(sorted(manifest.files)) if i % ranks.world_size == ranks.rank}
    verify_file_hashes(path, manifest, sorted(to_read | spread))
    pieces = _read_pieces(path, manifest, reads, target)
    check_slice_lengths(pieces, target.specs)
    shapes = _kept_shapes(target)
    full = assemble(pieces, shapes)
    check_state_values(full, target.specs, target.policy, shapes)
    weights = None
    if with_weights and target.model is not None:  # with_weights implies a model
        weights = read_weights(path, manifest)
        check_weights(weights, target.model)
        check_finite_weights(weights, target.policy)
    if manifest.framework != "torch":
        groups = [dict(g) for g in target.param_groups]
        hyper = _hyper_warning(shown, manifest, target)
        return Loaded(manifest.step, full, groups, weights, dict(manifest.extra), hyper)
    groups = []
    saved_groups = manifest.extra.get("param_groups", [])
    for saved, current in zip(saved_groups, target.param_groups, strict=True):
        values = {k: from_json(v, current.get(k)) for k, v in saved.items() if k != "params"}
        groups.append({**values, "params": current["params"]})
    return Loaded(manifest.step, full, groups, weights, dict(manifest.extra))


def _hyper_warning(shown: str, manifest: Manifest, target: LoadTarget) -> str | None:
    """What the JAX checkpoint's Optax computed with (``extra["hyperparams"]``) that the
    param groups kept here do not, as a ``HyperparameterWarning``; ``None`` if nothing."""
    canonical = canonical_optimizer(manifest.optimizer)
    saved = manifest.extra.get("hyperparams")
    if canonical is None or not isinstance(saved, dict):
        return None
    here = [
        {k: v.item() if torch.is_tensor(v) else v for k, v in g.items() if k != "params"}
        for g in target.param_groups
    ]
    keeps = "a JAX checkpoint has no param groups to restore"
    return hyperparameter_warning(shown, manifest.optimizer, [saved], here, canonical, keeps=keeps)


def load(path: str | os.PathLike[str], target: LoadTarget, ranks: RankGroup) -> Loaded:
    """Read a checkpoint written at any world size for ``target`` (a collective).

    Raises:
        CheckpointError: on every rank, naming the first rank's problem (missing or corrupt
            file, another model or optimizer class, other param groups); nothing is
            returned to any rank, so no rank's state changes.
    """
    agreement = RankSaveAgreement(ranks)
    # Rank 0 resolves PATH once and every rank reads that version: a save that switches PATH
    # meanwhile can mix versions neither within a rank nor across ranks.
    version = agreement.share_token(resolve_checkpoint(path) if agreement.leader else None)
    error: str | None = None
    try:
        loaded = _read(version, target, ranks, os.fspath(path))
    except Exception as e:  # any failure must reach the other ranks, or they would load
        error = error_message(e)
    what = f"cannot load optimizer checkpoint {os.fspath(path)}"
    agreement.all_ok(error, what)
    if loaded.hyper_warning:  # agreed: every rank loads, and says so
        warnings.warn(loaded.hyper_warning, HyperparameterWarning, stacklevel=3)
    return loaded
