"""Save and load ``shard_optimizer`` state in gradsync's per-parameter format (docs/design.md §9).

The files are the ones ``gradsync_torch``'s ZeRO optimizer writes: a manifest plus one
safetensors file per rank, tensors named ``"<param name>/<state key>"`` in model space (the
full tensor), so a checkpoint saved on 8 devices loads on 4, or with the other partition.
Rank ``d``'s file holds the parameters device ``d`` owns (greedy) or whose first element it
owns (flat). Leaves tied to no parameter (``count``, injected hyper-parameters) go to rank 0's
file under ``"__optax__/<state path>"`` and are listed in ``manifest.extra["global_keys"]``.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save as save_bytes

from gradsync_core import (
    MANIFEST,
    RANK_FILE_RE,
    Manifest,
    check_compatible,
    rank_file,
    read_manifest,
    sha256_file,
    tensor_key,
    write_atomic,
    write_manifest,
)
from gradsync_jax.zero.layout import ZeroState
from gradsync_jax.zero.transform import ShardedOptimizer

GLOBAL_PARAM = "__optax__"  # the pseudo-parameter that carries global leaves


# safetensors dtype names -> NumPy; safetensors.numpy.load has no bfloat16 (it raises
# KeyError 'BF16'), while its save writes BF16 correctly and torch reads it.
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


def _read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file (format: u64 header size, JSON header, data)."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + size :]
    out = {}
    for key, entry in header.items():
        start, stop = entry["data_offsets"]
        array = np.frombuffer(body[start:stop], dtype=_DTYPES[entry["dtype"]])
        out[key] = array.reshape(entry["shape"]).copy()
    return out


def _file_rank(tx: ShardedOptimizer, params: Any) -> dict[str, int]:
    """Which rank writes each parameter: its owner, or the owner of its first element."""
    # Every parameter has exactly one shard starting at element 0.
    return {shard.name: shard.rank for shard in tx.plan(params).shards if shard.start == 0}


def save_optimizer_state(
    directory: str | os.PathLike[str],
    tx: ShardedOptimizer,
    state: ZeroState,
    params: Any,
    *,
    step: int,
    optimizer: str | None = None,
) -> Manifest:
    """Write ``state`` to ``directory`` (created if missing); the manifest is written last.

    Args:
        directory: the checkpoint directory.
        tx: the ``shard_optimizer`` that made ``state``.
        state: its state (arrays addressable from this process).
        params: the parameter tree (arrays or ``ShapeDtypeStruct``) the state belongs to.
        step: the training step, stored in the manifest.
        optimizer: a name checked on load; default derived from the state's types
            (``"optax:ScaleByAdamState,EmptyState"``).

    Returns:
        The manifest written.

    Raises:
        ValueError: if the state is not fully addressable (multi-process JAX is not
            supported by this writer yet) or does not match ``params``.

    Example:
        >>> save_optimizer_state("ckpt/opt", tx, opt_state, params, step=100)
    """
    for leaf in [*state.shards.values()]:
        if hasattr(leaf, "is_fully_addressable") and not leaf.is_fully_addressable:
            raise ValueError(
                "the optimizer state is spread over several processes; this writer needs "
                "every shard addressable from one process (single-process JAX)"
            )
    layout = tx.layout(params)
    space = layout.space
    values = layout.gather(ZeroState(inner=state.inner, shards=dict(state.shards)))
    writer = _file_rank(tx, params)
    n = tx.world_size
    files: list[dict[str, np.ndarray]] = [{} for _ in range(n)]
    state_keys: dict[str, list[str]] = {spec.name: [] for spec in space.specs}
    global_keys = []
    for leaf, value in zip(space.leaves, values, strict=True):
        value = np.array(value, order="C")  # ascontiguousarray would make 0-d arrays 1-d
        if leaf.param is None:
            files[0][tensor_key(GLOBAL_PARAM, leaf.key)] = value
            global_keys.append(leaf.key)
        else:
            name = space.specs[leaf.param].name
            files[writer[name]][tensor_key(name, leaf.key)] = value
            state_keys[name].append(leaf.key)
    os.makedirs(directory, exist_ok=True)
    # Remove the old manifest first: a save cut short then reads as "not finished", never as
    # the old checkpoint with some new rank files (which the hashes would also catch).
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(directory, MANIFEST))
    hashes = {}
    for rank, tensors in enumerate(files):
        path = os.path.join(directory, rank_file(rank, n))
        write_atomic(path, save_bytes(tensors, metadata={"framework": "jax"}))
        hashes[rank_file(rank, n)] = sha256_file(path)
    manifest = Manifest(
        framework="jax",
        optimizer=optimizer or space.optimizer,
        world_size=n,
        step=int(step),
        params=space.specs,
        plan=tx.plan(params),
        state_keys={k: tuple(v) for k, v in state_keys.items()},
        files=hashes,
        extra={"partition": tx.partition, "global_keys": global_keys},
    )
    write_manifest(directory, manifest)
    for name in os.listdir(directory):  # rank files of an earlier save on another device count
        if RANK_FILE_RE.fullmatch(name) and name not in hashes:
            os.unlink(os.path.join(directory, name))
    return manifest


def load_optimizer_state(
    directory: str | os.PathLike[str],
    tx: ShardedOptimizer,
    params: Any,
    *,
    optimizer: str | None = None,
) -> tuple[ZeroState, Manifest]:
    """Read a checkpoint into a new state for ``tx`` (any device count, either partition).

    Every file is checked against its manifest hash and every tensor against the expected
    shape and dtype before anything is placed on a device; on any error nothing changes
    (the state is a new value: keep using the old one).

    Args:
        directory: a checkpoint written by ``save_optimizer_state``.
        tx: the ``shard_optimizer`` to load into (its mesh may differ from the saver's).
        params: the parameter tree (arrays or ``ShapeDtypeStruct``).
        optimizer: the name given at save time, if one was.

    Returns:
        ``(state, manifest)``; ``state`` is placed with ``tx.state_shardings(params)``.

    Raises:
        ValueError: one sentence naming what is missing, corrupt or different.

    Example:
        >>> opt_state, manifest = load_optimizer_state("ckpt/opt", tx, params)
    """
    manifest = read_manifest(directory)
    layout = tx.layout(params)
    space = layout.space
    if manifest.framework != "jax":
        raise ValueError(
            f"{directory!s} was written by {manifest.framework!r}; this loader reads "
            "checkpoints written by gradsync_jax (optax state names)"
        )
    check_compatible(manifest, space.specs, optimizer=optimizer or space.optimizer)
    tensors: dict[str, np.ndarray] = {}
    for name in manifest.files:
        try:
            loaded = _read_safetensors(os.path.join(directory, name))
        except Exception as err:  # a malformed header or a dtype this reader does not know
            raise ValueError(f"checkpoint file {name} cannot be read ({err})") from None
        for key, value in loaded.items():
            if key in tensors:
                raise ValueError(f"checkpoint tensor {key!r} appears in two rank files")
            tensors[key] = value
    values = []
    expected = set()
    for leaf in space.leaves:
        param = GLOBAL_PARAM if leaf.param is None else space.specs[leaf.param].name
        key = tensor_key(param, leaf.key)
        expected.add(key)
        if key not in tensors:
            raise ValueError(
                f"checkpoint has no tensor {key!r}: it was saved from another optimizer "
                "configuration"
            )
        value = tensors[key]
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
    state = tx.scatter_state(space.state_treedef.unflatten(values), params)
    return state, manifest
