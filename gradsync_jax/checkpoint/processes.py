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

A save with ``blocking=False`` agrees in a background thread while training goes on, where
a device collective (``process_allgather`` compiles and runs a computation over every
device) would interleave with the training step's own on each process differently. So it
agrees through the distributed client's key-value store instead (``KeyValueSaveAgreement``):
each process publishes its answer under a key of its own and reads the others', blocking
with a timeout, which releases the GIL; no device is involved.

Rank files are written by different processes into one directory, so the checkpoint path
must be on a file system every process sees (NFS, Lustre, a local disk for one host).
"""

from __future__ import annotations

import itertools
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


def copied_view(tree: Any, into: Callable[[tuple[int, ...], Any], np.ndarray]) -> Any:
    """``local_view(tree)`` copied into host arrays that ``into(shape, dtype)`` hands out (a
    save's staging buffer): each device's shard copied once into its place (a replicated
    leaf from one device), the parts only other processes hold zeros. No collective. 0-d
    leaves are copied apart (``np.array``): a few bytes each.

    The arrays are the save's own: the training may donate the device buffers once this
    returns (``np.asarray`` of a CPU array can be a view of its buffer, which is why a save
    in the background copies)."""

    moved = _in_host_memory(tree)

    def host(leaf: Any) -> Any:
        if not isinstance(leaf, jax.Array) or leaf.ndim == 0:
            return np.array(leaf, copy=True)
        out = into(tuple(leaf.shape), leaf.dtype)
        if not leaf.is_fully_addressable:
            out.fill(0)
        leaf = moved.get(id(leaf), leaf)
        if leaf.is_fully_replicated:
            np.copyto(out, np.asarray(leaf.addressable_data(0)))
            return out
        done = set()
        for shard in leaf.addressable_shards:
            where = tuple(i.indices(n) for i, n in zip(shard.index, leaf.shape, strict=True))
            if where not in done:  # a shard replicated over another axis: copied once
                done.add(where)
                out[shard.index] = np.asarray(shard.data)
        return out

    return jax.tree.map(host, tree)


def _in_host_memory(tree: Any) -> dict[int, Any]:
    """Every accelerator array of ``tree`` moved to pinned host memory in one
    ``jax.device_put`` (the copies run together at the link's speed), by ``id(leaf)``; host
    (CPU) arrays are read in place and are not listed. Measured on one H200, 144 arrays of
    4 MiB: one ``np.asarray`` after another 378-724 ms, ``copy_to_host_async`` first
    211-279 ms, this 119-122 ms, the copy into the staging buffer included."""
    leaves = [
        leaf
        for leaf in jax.tree.leaves(tree)
        if isinstance(leaf, jax.Array)
        and leaf.ndim > 0
        and any(device.platform != "cpu" for device in leaf.devices())
    ]
    if not leaves:
        return {}
    shardings = [leaf.sharding.with_memory_kind("pinned_host") for leaf in leaves]
    moved = jax.device_put(leaves, shardings)
    return {id(leaf): host for leaf, host in zip(leaves, moved, strict=True)}


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


# How long a process waits for another's answer in a background save's agreement: long enough
# for a slow peer's fsync of a large file, short enough that a lost peer ends the save.
KEY_VALUE_TIMEOUT_S = 1800.0
_KEY_PREFIX = "gradsync/background_save"
_saves = itertools.count()  # background saves started by this process, the same on every one


def _client() -> Any:
    from jax._src import distributed  # the client jax.distributed.initialize made

    client = distributed.global_state.client
    if client is None:
        raise RuntimeError("jax.distributed is not initialized, so there is no key-value store")
    return client


class KeyValueSaveAgreement:
    """``SaveAgreement`` of a background save over the JAX processes, through the distributed
    client's key-value store (process 0 leads).

    Every verb is one round: each process sets ``<save>/<round>/<process>`` and reads every
    process's key of that round. The saves are numbered in the order the processes make
    them (a collective, so alike everywhere); once every process has answered a save's first
    round, all of them are past the previous save, whose keys process 0 then deletes.
    """

    def __init__(self, timeout_s: float = KEY_VALUE_TIMEOUT_S) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()
        self.client = _client()
        self.save = next(_saves)
        self.timeout_ms = int(timeout_s * 1000)
        self._round = 0

    @property
    def leader(self) -> bool:
        """Whether this process opens the staging directory and writes the manifest."""
        return self.index == 0

    @property
    def who(self) -> str:
        """``"process 1"``, as errors name this process."""
        return f"process {self.index}"

    def _exchange(self, value: Any) -> list[Any]:
        """Every process's JSON-able ``value`` of this round, in process order."""
        round_ = f"{_KEY_PREFIX}/{self.save}/{self._round}"
        self._round += 1
        self.client.key_value_set(f"{round_}/{self.index}", json.dumps(value))
        values = [
            json.loads(self.client.blocking_key_value_get(f"{round_}/{p}", self.timeout_ms))
            for p in range(self.count)
        ]
        if self._round == 1 and self.leader and self.save > 0:
            self.client.key_value_delete(f"{_KEY_PREFIX}/{self.save - 1}")
        return values

    def all_ok(self, error: str | None, what: str) -> None:
        """Raise the first failing process's ``error`` as ``CheckpointError`` everywhere."""
        failed = [(p, e) for p, e in enumerate(self._exchange(error)) if e is not None]
        if failed:
            process, message = failed[0]
            raise CheckpointError(f"{what} (process {process}): {message}")

    def share_token(self, token: str | None) -> str:
        """Process 0's save token, on every process."""
        shared = self._exchange(token)[0]
        assert isinstance(shared, str)  # process 0 failed to make one: all_ok raised before
        return shared

    def gather(self, record: Any) -> list[Any]:
        """Every process's JSON-able ``record``, in process order."""
        return self._exchange(record)


def background_agreement() -> ProcessSaveAgreement | KeyValueSaveAgreement:
    """The agreement of a save in the background: none needed with one process (no
    collectives), else the key-value store's."""
    if jax.process_count() == 1:
        return ProcessSaveAgreement()
    return KeyValueSaveAgreement()


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
