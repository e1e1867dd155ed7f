"""Checkpoint saves and loads when several JAX processes share the mesh (docs/checkpoints.md).

With ``jax.distributed`` each process sees only its own devices' shards of the optimizer
state. A save therefore works from a *local view*: the state copied to host memory with the
shards of other processes' devices left as zeros; the process writes only the rank files of
the ranks whose devices it holds, where that view is exact for the greedy partition (whole
parameters per device). The flat partition owns element ranges of Flax-layout buckets, but
its rank files hold element ranges of torch-layout tensors (a Dense kernel transposed), which
another process's devices may hold: a flat save gathers the state on every process first.

``ProcessSaveAgreement`` is the ``SaveAgreement`` of ``gradsync_core.checkpoint.run_save`` on
these processes, so a failure on one process is the same ``CheckpointError`` on all and
nothing half-written ever becomes the checkpoint (the steps: docs/design.md §9). A load that
reads only each process's part (``load_param_shards``) ends in the same agreement
(``agreed_read``): a check that failed on one process fails the load on all.

Rank files are written by different processes into one directory, so the checkpoint path
must be on a file system every process sees (NFS, Lustre, a local disk for one host).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any, TypeVar, cast

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

from gradsync_core.checkpoint import CheckpointError, error_message

T = TypeVar("T")

_TOKEN_BYTES = 64  # room for a save token (16 hex digits today)


def local_ranks(mesh: Mesh, axes: tuple[str, ...]) -> frozenset[int]:
    """The data-parallel ranks (positions along ``axes``, major to minor) whose rank files
    this process writes: those whose first device in the mesh's order belongs to it.

    A rank spans several devices when the mesh has axes besides ``axes`` (the replicas of
    hybrid sharding hold the same shard), and those devices may belong to different
    processes; each file must have one writer, and the first device's process holds the
    rank's shard, so its local view is exact there."""
    sizes = [mesh.shape[a] for a in axes]
    positions = [mesh.axis_names.index(a) for a in axes]
    first: dict[int, int] = {}
    for index in np.ndindex(mesh.devices.shape):  # C order: the mesh's order
        rank = int(np.ravel_multi_index([index[p] for p in positions], sizes))
        first.setdefault(rank, cast(jax.Device, mesh.devices[index]).process_index)
    return frozenset(r for r, process in first.items() if process == jax.process_index())


def local_view(tree: Any, *, complete: bool = False) -> Any:
    """``tree`` with every array copied to host memory; the parts held only by other
    processes' devices are zeros (replicated leaves are therefore complete), or, with
    ``complete``, fetched from those processes (a collective: every process must call it)."""
    if complete and jax.process_count() > 1:
        return jax.tree.map(np.asarray, multihost_utils.process_allgather(tree, tiled=True))

    def host(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or leaf.is_fully_addressable:
            return np.asarray(leaf)
        out = np.zeros(leaf.shape, leaf.dtype)
        for shard in leaf.addressable_shards:
            out[shard.index] = np.asarray(shard.data)
        return out

    return jax.tree.map(host, tree)


def place(host_tree: Any, shardings: Any) -> Any:
    """Put a host tree that every process holds in full onto a mesh that may span
    processes: each process fills only its own devices' shards."""

    def put(value: Any, sharding: NamedSharding) -> jax.Array:
        value = np.asarray(value)
        return jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    return jax.tree.map(put, host_tree, shardings)


def _gather_bytes(data: bytes) -> list[bytes]:
    """Every process's ``data``, in process order (two all-gathers: lengths, then bytes)."""
    lengths = np.asarray(multihost_utils.process_allgather(np.asarray([len(data)], np.int64)))
    lengths = lengths.reshape(-1)
    padded = np.zeros(int(lengths.max()), np.uint8)
    padded[: len(data)] = np.frombuffer(data, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(padded)).reshape(len(lengths), -1)
    return [bytes(row[:n]) for row, n in zip(rows, lengths.tolist(), strict=True)]


class ProcessSaveAgreement:
    """``SaveAgreement`` over the JAX processes (process 0 leads; no-ops with one process)."""

    def __init__(self) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()

    @property
    def leader(self) -> bool:
        """Whether this process opens the staging directory and writes the manifest."""
        return self.index == 0

    @property
    def who(self) -> str:
        """``"process 1"``, as errors name this process."""
        return f"process {self.index}"

    def all_ok(self, error: str | None, what: str) -> None:
        """Raise the first failing process's ``error`` as ``CheckpointError`` everywhere."""
        errors = [error]
        if self.count > 1:
            errors = [json.loads(e) for e in _gather_bytes(json.dumps(error).encode("utf-8"))]
        failed = [(p, e) for p, e in enumerate(errors) if e is not None]
        if failed:
            process, message = failed[0]
            where = f" (process {process})" if self.count > 1 else ""
            raise CheckpointError(f"{what}{where}: {message}")

    def share_token(self, token: str | None) -> str:
        """Process 0's save token, on every process."""
        if self.count == 1:
            assert token is not None
            return token
        raw = np.zeros(_TOKEN_BYTES, np.uint8)
        if token is not None:
            raw[: len(token)] = np.frombuffer(token.encode("ascii"), np.uint8)
        shared = np.asarray(multihost_utils.broadcast_one_to_all(raw))
        return bytes(shared).rstrip(b"\0").decode("ascii")

    def gather(self, record: Any) -> list[Any]:
        """Every process's JSON-able ``record``, in process order."""
        if self.count == 1:
            return [record]
        return [json.loads(r) for r in _gather_bytes(json.dumps(record).encode("utf-8"))]


def agreed_read(read: Callable[[], T], version: str, what: str) -> T:
    """``read()`` on every process, then agreed: if it failed on any process, every process
    raises ``CheckpointError`` naming the first that failed (on that one its error is the
    cause), so none goes on with a state another refused. Every process must have read the
    same checkpoint version (``version``, resolved on each); a save that switched the path in
    between fails the load the same way. With one process, ``read()`` as it is.

    Raises:
        CheckpointError: ``"{what} (process P): ..."``, on every process.
    """
    if jax.process_count() == 1:
        return read()
    caught: Exception | None = None
    try:
        result = read()
    except Exception as err:  # held until every process knows
        caught, result = err, None
    agreement = ProcessSaveAgreement()
    versions = agreement.gather(os.path.basename(version))
    error = None if caught is None else error_message(caught)
    if error is None and len(set(versions)) > 1:
        error = (
            f"process {agreement.index} read version {versions[agreement.index]} but process "
            f"0 read {versions[0]}: a save switched the checkpoint during the load; load again"
        )
    try:
        agreement.all_ok(error, what)
    except CheckpointError as agreed:
        raise agreed from caught
    return result  # type: ignore[return-value]
