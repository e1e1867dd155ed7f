"""Checkpoint saves and loads when several JAX processes share the mesh (docs/checkpoints.md).

With ``jax.distributed`` each process sees only its own devices' shards of the optimizer
state. A save therefore works from a *local view*: the state copied to host memory with the
shards of other processes' devices left as zeros; the process writes only the rank files of
the ranks whose devices it holds, where that view is exact for the greedy partition (whole
parameters per device). The flat partition owns element ranges of Flax-layout buckets, but
its rank files hold element ranges of torch-layout tensors (a Dense kernel transposed), which
another process's devices may hold: a flat save gathers the state on every process first.

``SaveAgreement`` turns the one save into steps every process takes together, so a failure
on one process is a failure on all and nothing half-written ever becomes the checkpoint:

1. every process prepares its files (an error is held, not raised, until step 2);
2. all agree that every process prepared; process 0 opens the staging directory and
   broadcasts its token;
3. every process writes its files there and hashes them; the hashes are gathered;
4. process 0 writes the manifest and switches the checkpoint; all learn whether it worked.

Rank files are written by different processes into one directory, so the checkpoint path
must be on a file system every process sees (NFS, Lustre, a local disk for one host).
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

_DIGEST_BYTES = 32  # sha256
_TOKEN_BYTES = 64  # room for a save token (16 hex digits today)


def local_ranks(mesh: Mesh, axes: tuple[str, ...]) -> frozenset[int]:
    """The data-parallel ranks (positions along ``axes``, major to minor) whose devices
    belong to this process."""
    sizes = [mesh.shape[a] for a in axes]
    positions = [mesh.axis_names.index(a) for a in axes]
    mine = set()
    for index in np.ndindex(mesh.devices.shape):
        if mesh.devices[index].process_index == jax.process_index():
            mine.add(int(np.ravel_multi_index([index[p] for p in positions], sizes)))
    return frozenset(mine)


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


class SaveAgreement:
    """The collective steps of one multi-process save (no-ops with a single process)."""

    def __init__(self) -> None:
        self.count = jax.process_count()
        self.index = jax.process_index()

    @property
    def leader(self) -> bool:
        """Whether this process opens the staging directory and writes the manifest."""
        return self.index == 0

    def all_ok(self, ok: bool, what: str) -> None:
        """Raise on every process unless ``ok`` holds on every process."""
        if self.count == 1:
            return
        flags = np.asarray(multihost_utils.process_allgather(np.asarray([ok], np.bool_)))
        failed = [int(p) for p in np.flatnonzero(~flags.reshape(self.count))]
        if failed and ok:
            raise RuntimeError(
                f"process {failed[0]} failed while {what}, so this save was abandoned on every "
                "process; its log says why"
            )

    def share_token(self, token: str | None) -> str:
        """Process 0's save token, on every process (``None`` on process 0: it failed)."""
        if self.count == 1:
            assert token is not None
            return token
        raw = np.zeros(_TOKEN_BYTES, np.uint8)
        if token is not None:
            raw[: len(token)] = np.frombuffer(token.encode("ascii"), np.uint8)
        shared = np.asarray(multihost_utils.broadcast_one_to_all(raw))
        return bytes(shared).rstrip(b"\0").decode("ascii")

    def gather_digests(self, mine: dict[int, str], world_size: int) -> dict[int, str]:
        """Every rank file's sha256 (hex), each hashed by the process that wrote it."""
        if self.count == 1:
            return dict(mine)
        table = np.zeros((world_size, _DIGEST_BYTES), np.uint8)
        for rank, digest in mine.items():
            table[rank] = np.frombuffer(bytes.fromhex(digest), np.uint8)
        everyone = np.asarray(multihost_utils.process_allgather(table))
        # Each rank is written by exactly one process, so the other rows are zero.
        return {rank: bytes(everyone[:, rank].max(axis=0)).hex() for rank in range(world_size)}
