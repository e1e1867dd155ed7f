"""Worker of the bytes-read test: ``python checkpoint_reads_worker.py PROCESS_ID NUM_PROCESSES
PORT OUT_DIR LOCAL_DEVICES`` (as ``distributed_start.launch`` runs it).

Each process owns ``LOCAL_DEVICES`` CPU devices of a ``jax.distributed`` job on 127.0.0.1. The
processes build a ZeRO-3 step (``zero3_step``) over all the devices for an MLP whose dim-0 rows
split evenly except one parameter's, take one AdamW step, save it (``save_param_shards``) and
load it back (``load_param_shards``) while every read of a checkpoint file is counted: each
file the loaders open goes through ``gradsync_core.checkpoint.open_checkpoint_file``, which
is wrapped here (in every module that imported it) to count the bytes each read returns, by
file and by reader (the hash check, ``sha256_file``; the rest). ``/proc/self/io``'s
``rchar`` (bytes every ``read`` system call of the process returned) is recorded around the
same load as a check that nothing read the files another way. The load must be bitwise the
state in memory. Then a copy with one byte changed in a file that only the last process
hashes, but process 0 reads from, must fail to load on every process. Each process writes
``OUT_DIR/reads_<process>.json``.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import sys
from collections import Counter
from collections.abc import Iterator
from typing import Any

import numpy as np

from tests.jax.distributed_start import start_process

# torch rows (Flax Dense kernels are transposed): 256, 256, 64 and their biases split evenly
# over 2, 4 and 8 devices; the embedding's 100 rows do not (13 per device at 8, the last 9).
SHAPES = {
    "embed": {"embedding": (100, 64)},
    "dense_0": {"kernel": (64, 256), "bias": (256,)},
    "dense_1": {"kernel": (256, 256), "bias": (256,)},
    "dense_2": {"kernel": (256, 64), "bias": (64,)},
}


def init_params() -> Any:
    rng = np.random.default_rng(0)
    return {
        module: {
            name: rng.standard_normal(shape).astype(np.float32) * 0.05
            for name, shape in leaves.items()
        }
        for module, leaves in SHAPES.items()
    }


def loss_fn(params: Any, batch: Any) -> Any:
    import jax.numpy as jnp

    h = params["embed"]["embedding"][batch]
    for i in range(3):
        h = jnp.tanh(h @ params[f"dense_{i}"]["kernel"] + params[f"dense_{i}"]["bias"])
    return jnp.mean(h**2)


class _Counting(io.RawIOBase):
    """A read-only file that adds every byte its reads return to ``counts[name]``."""

    def __init__(self, f: Any, name: str, counts: Counter[str]) -> None:
        self._f, self._name, self._counts = f, name, counts

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = self._f.readinto(buffer)
        self._counts[self._name] += n or 0
        return n

    def read(self, size: int = -1) -> bytes:
        data = self._f.read(size)
        self._counts[self._name] += len(data)
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()

    def fileno(self) -> int:
        return self._f.fileno()

    def close(self) -> None:
        self._f.close()
        super().close()


@contextlib.contextmanager
def counted_reads() -> Iterator[dict[str, Counter[str]]]:
    """Count the bytes read from checkpoint files: ``{"hash": ..., "other": ...}`` by file name
    (what ``sha256_file`` reads, and the rest)."""
    from gradsync_core.checkpoint import _files, _storage

    real = _files.open_checkpoint_file
    real_sha = _storage.sha256_file
    counts: dict[str, Counter[str]] = {"hash": Counter(), "other": Counter()}
    hashing = [False]

    def opener(directory: Any, name: str) -> Any:
        f = real(directory, name)
        return _Counting(f, name, counts["hash" if hashing[0] else "other"])

    def sha(path: Any) -> str:
        hashing[0] = True
        try:
            return real_sha(path)
        finally:
            hashing[0] = False

    patched = []
    for module in list(sys.modules.values()):
        for attr, fn, new in (
            ("open_checkpoint_file", real, opener),
            ("sha256_file", real_sha, sha),
        ):
            if getattr(module, attr, None) is fn:
                patched.append((module, attr, fn))
                setattr(module, attr, new)
    try:
        yield counts
    finally:
        for module, attr, fn in patched:
            setattr(module, attr, fn)


def rchar() -> int:
    with open("/proc/self/io", encoding="ascii") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("rchar:"))


def main(process_id: int, num_processes: int, local_devices: int, port: int, out_dir: str) -> None:
    start_process(process_id, num_processes, port, local_devices)
    import jax
    import optax
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh

    from gradsync_core import read_manifest
    from gradsync_core.checkpoint import read_header, resolve_checkpoint
    from gradsync_jax import (
        load_param_shards,
        param_layout,
        save_param_shards,
        shard_params,
        zero3_step,
    )

    n = jax.device_count()
    mesh = Mesh(np.array(jax.devices()), ("dp",))
    layout = param_layout(init_params(), world_size=n)
    step = zero3_step(loss_fn, optax.adamw(1e-2), mesh, layout)
    params = shard_params(init_params(), mesh, layout)
    state = step.init(params)
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from gradsync_jax.checkpoint.processes import place

    tokens = place(np.arange(8 * n) % 100, NamedSharding(mesh, P("dp")))
    params, state, _ = step(params, state, tokens)
    path = os.path.join(out_dir, "ckpt")
    save_param_shards(path, step, params, state, step=1)
    load_param_shards(path, step)  # first, so that imports and compilations are not counted
    multihost_utils.sync_global_devices("warm")
    before = rchar()
    with counted_reads() as counts:
        loaded = load_param_shards(path, step)[:2]
    after = rchar()
    gather = lambda tree: [  # noqa: E731
        np.asarray(v) for v in jax.tree.leaves(multihost_utils.process_allgather(tree, tiled=True))
    ]
    same = all(
        np.array_equal(a, b)
        for a, b in zip(gather((params, state)), gather(tuple(loaded)), strict=True)
    )
    held = _held_bytes(step, state)
    version = resolve_checkpoint(path)
    manifest = read_manifest(version, verify_files=False)
    files = {}
    for name in manifest.files:
        header, start = read_header(os.path.join(version, name))
        size = os.path.getsize(os.path.join(version, name))
        entries = {key: (e["data_offsets"][1] - e["data_offsets"][0]) for key, e in header.items()}
        files[name] = {"size": size, "header": start, "tensors": entries}
    record = {
        "process": process_id,
        "processes": num_processes,
        "devices": n,
        "same": same,
        "hash": dict(counts["hash"]),
        "other": dict(counts["other"]),
        "rchar": after - before,
        "held": held,
        "files": files,
        "manifest": os.path.getsize(os.path.join(version, "manifest.json")),
    }
    record["refused"] = _refused(path, step, out_dir, process_id, num_processes)
    with open(os.path.join(out_dir, f"reads_{process_id}.json"), "w") as f:
        json.dump(record, f)
    multihost_utils.sync_global_devices("done")
    jax.distributed.shutdown()


def _refused(path: str, step: Any, out_dir: str, process_id: int, num_processes: int) -> str:
    """How a copy of the checkpoint with one byte changed in rank 1's file (which device 1's
    process reads from, and with 2 processes only the other one hashes) fails to load here:
    ``"Type: message"`` (``"loaded"`` if it did not)."""
    import shutil

    from jax.experimental import multihost_utils

    from gradsync_core import read_manifest
    from gradsync_core.checkpoint import rank_file, resolve_checkpoint
    from gradsync_jax import load_param_shards

    version = resolve_checkpoint(path)
    target = rank_file(1, read_manifest(version, verify_files=False).world_size)
    bad = os.path.join(out_dir, "bad")
    if process_id == 0:
        shutil.copytree(version, bad)
        with open(os.path.join(bad, target), "r+b") as f:  # the last float's lowest byte
            f.seek(-4, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-4, os.SEEK_END)
            f.write(bytes([byte ^ 1]))
    multihost_utils.sync_global_devices("corrupted")
    try:
        load_param_shards(bad, step)
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "loaded"


def _held_bytes(step: Any, state: Any) -> int:
    """The bytes of the rows this process's devices hold, padding left out: of every weight
    and of every state leaf shaped like its parameter (AdamW's two moments)."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layout = step.layout
    sharding = NamedSharding(step.mesh, P(step.axes))
    moments = sum(  # per-parameter state leaves per trainable parameter
        1 for leaf in jax.tree.leaves(state) if leaf.ndim and leaf.sharding.spec != P()
    ) // sum(leaf.trainable for leaf in layout.leaves)
    total = 0
    for leaf in layout.leaves:
        shape = (leaf.padded_rows * layout.world_size, *leaf.torch_shape[1:])
        row = int(np.prod(leaf.torch_shape[1:])) * np.dtype(leaf.dtype).itemsize
        slices = {
            index[0].indices(shape[0])[:2]
            for index in sharding.addressable_devices_indices_map(shape).values()
        }
        rows = sum(max(0, min(b, leaf.rows) - a) for a, b in slices)
        total += rows * row * (1 + (moments if leaf.trainable else 0))
    return total


if __name__ == "__main__":
    process_id, num_processes, port, out_dir, local_devices = sys.argv[1:6]
    main(int(process_id), int(num_processes), int(local_devices), int(port), out_dir)
