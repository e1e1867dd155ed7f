"""The model-space tensors of a checkpoint's rank files, read by the ranges a load keeps.

``StoredFiles`` (docs/checkpoints.md) reads every rank file's header (bounded) and locates each
model-space tensor ``"<name>/<key>"``: per the manifest's plan, whole in one file (greedy) or as
flat slices across files (flat, dim0), or whole where a file holds it (version 1, Optax's global
leaves). Its stand-ins (arrays of the shape and dtype, holding no data) let every check of
shapes and dtypes run before any tensor is read. The reads are the core's
(``gradsync_core.checkpoint.state_reads``, ``weight_reads``: which element range of which stored
tensor fills which part of a window), each read straight into its place in the caller's buffer,
so a load that keeps only some rows reads only those, once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, BinaryIO

import numpy as np

from gradsync_core import Manifest
from gradsync_core.checkpoint import (
    MODEL_PARAM,
    Window,
    WindowRead,
    model_key,
    open_checkpoint_file,
    rank_file,
    state_reads,
    weight_owners,
    weight_reads,
)
from gradsync_jax.checkpoint.safetensors_io import TensorEntry, read_elements, read_entries

GLOBAL_PARAM = "__optax__"  # the pseudo-parameter that carries global leaves


class StoredFiles:
    """The rank files of one checkpoint version, by their headers; reads element ranges.

    Use it as a context manager: the files it reads from stay open until the end.

    Raises:
        ValueError: (on construction) naming a rank file whose header cannot be read.
    """

    def __init__(self, directory: str | os.PathLike[str], manifest: Manifest) -> None:
        self.directory, self.manifest = os.fspath(directory), manifest
        self.entries: dict[str, dict[str, TensorEntry]] = {}
        for rank in range(manifest.world_size):
            name = rank_file(rank, manifest.world_size)
            try:
                self.entries[name] = read_entries(os.path.join(self.directory, name))
            except Exception as err:  # a malformed header or a dtype this reader does not know
                raise ValueError(f"checkpoint file {name} cannot be read ({err})") from err
        self._open: dict[str, BinaryIO] = {}
        self.in_file: dict[str, str] = {}  # state stored whole where a file holds it: its file

    def __enter__(self) -> StoredFiles:
        return self

    def __exit__(self, *_: Any) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def state(self) -> dict[str, np.ndarray]:
        """Stand-ins of every model-space state tensor the files hold, by ``"<name>/<key>"``:
        a whole stored tensor's shape, or for flat slices the parameter's shape (once every
        slice was found with its length and one dtype); Optax's global leaves as stored. A
        tensor the plan does not place (a global leaf, version 1, a parameter it lacks) is
        read whole from its file (``in_file``); the others through the plan.

        Raises:
            ValueError: naming a tensor that lacks a slice in a rank file or has a slice of
                another length or dtype.
        """
        plan = self.manifest.plan
        shapes = {spec.name: spec.shape for spec in self.manifest.params}
        shards: dict[str, list[Any]] = {}
        for shard in plan.shards:
            if shard.stop > shard.start:
                shards.setdefault(shard.name, []).append(shard)
        out: dict[str, np.ndarray] = {}
        for file, entries in self.entries.items():
            for key, entry in entries.items():
                pseudo = key.partition("/")[0]
                if key in out or pseudo == MODEL_PARAM:
                    continue
                name = key.rpartition("/")[0]
                if pseudo == GLOBAL_PARAM or self.manifest.version == 1 or name not in shards:
                    self.in_file[key] = file
                    out[key] = entry.stand_in()
                elif plan.kind == "greedy":
                    owner = rank_file(shards[name][0].rank, plan.world_size)
                    owned = self.entries[owner].get(key)
                    if owned is None:
                        raise ValueError(
                            f"checkpoint tensor {key!r} is not in {owner}, which the plan says "
                            "holds it"
                        )
                    out[key] = owned.stand_in()
                else:
                    out[key] = self._slices(key, shards[name], shapes[name])
        return out

    def _slices(self, key: str, shards: list[Any], shape: tuple[int, ...]) -> np.ndarray:
        """The stand-in of a tensor stored as flat slices, each one checked."""
        parts: list[TensorEntry] = []
        for shard in sorted(shards, key=lambda s: s.start):
            file = rank_file(shard.rank, self.manifest.world_size)
            part = self.entries[file].get(key)
            if part is None:
                raise ValueError(f"checkpoint tensor {key!r} is missing a slice in some rank file")
            if part.shape != (shard.stop - shard.start,):  # a named sentence
                raise ValueError(
                    f"checkpoint tensor {key!r} is {part.shape} in {file}, expected "
                    f"({shard.stop - shard.start},) for elements [{shard.start}, {shard.stop})"
                )
            if parts and part.dtype != parts[0].dtype:
                raise ValueError(
                    f"checkpoint tensor {key!r} is {part.dtype} in {file} but "
                    f"{parts[0].dtype} in another rank file: the files are corrupt"
                )
            parts.append(part)
        return np.broadcast_to(np.zeros((), parts[0].dtype), shape)

    def weights(self) -> dict[str, np.ndarray]:
        """Stand-ins of every stored model weight, by parameter name.

        Raises:
            ValueError: if the checkpoint holds no weights or a listed one is missing.
        """
        out = {}
        for param, rank in weight_owners(self.directory, self.manifest).items():
            file = rank_file(rank, self.manifest.world_size)
            entry = self.entries.get(file, {}).get(model_key(param))
            if entry is None:
                raise ValueError(f"checkpoint file {file} lacks the weight of {param!r}")
            out[param] = entry.stand_in()
        return out

    def read_state(self, shapes: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The state tensors ``shapes`` names (stand-ins from ``state``), each read whole."""
        out = {key: np.empty(like.shape, like.dtype) for key, like in shapes.items()}
        by_name: dict[str, list[str]] = {}
        for key in out:
            if key in self.in_file:
                self.read(self.in_file[key], key, 0, out[key].size, out[key])
            else:
                name, _, state_key = key.rpartition("/")
                by_name.setdefault(name, []).append(state_key)
        numel = {spec.name: spec.numel for spec in self.manifest.params}
        windows = [Window(name=name, start=0, stop=numel[name]) for name in by_name]
        for read in state_reads(self.manifest.plan, windows, by_name):
            for key in read.keys:
                self.read_piece(read, key, out[key].reshape(-1))
        return out

    def read_weights(self) -> dict[str, np.ndarray]:
        """Every stored model weight, whole, by parameter name."""
        out = {name: np.empty(like.shape, like.dtype) for name, like in self.weights().items()}
        windows = [Window(name=name, start=0, stop=w.size) for name, w in out.items()]
        owners = self.manifest.extra["model"]
        for read in weight_reads(owners, self.manifest.world_size, windows):
            self.read_piece(read, read.keys[0], out[read.window.name].reshape(-1))
        return out

    def read_piece(self, read: WindowRead, key: str, window: np.ndarray) -> None:
        """Read ``read``'s elements of tensor ``key`` into their place in ``window`` (the
        flattened window's buffer)."""
        self.read(read.file, key, read.start, read.stop, window[read.at : read.at + read.numel])

    def read(self, file: str, key: str, start: int, stop: int, out: np.ndarray) -> None:
        """Read elements ``[start, stop)`` of tensor ``key`` of rank file ``file`` into ``out``."""
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = open_checkpoint_file(self.directory, file)
        path = os.path.join(self.directory, file)
        read_elements(f, path, key, self.entries[file][key], start, stop, out)


def check_finite(tensors: Mapping[str, np.ndarray]) -> None:
    """Refuse a checkpoint whose state holds NaN or inf: loaded, the parameters would be NaN
    a step or two later (``load_optimizer_state`` and ``load_params`` take them with
    ``allow_nonfinite=True``).

    Raises:
        ValueError: naming the first such tensor.
    """
    for key, value in tensors.items():
        refuse_nonfinite(key, nonfinite(value))


def nonfinite(value: np.ndarray) -> int:
    """How many NaN or infinite values ``value`` holds (0 for integers and booleans)."""
    if value.dtype.kind in "biu":
        return 0
    return int(np.size(value) - np.count_nonzero(np.isfinite(value.astype(np.float32))))


def refuse_nonfinite(key: str, bad: int) -> None:
    """Refuse tensor ``key`` if it holds ``bad`` > 0 NaN or infinite values.

    Raises:
        ValueError: naming the tensor and the count.
    """
    if bad:
        raise ValueError(
            f"checkpoint tensor {key!r} holds {bad} NaN or infinite value(s); load an "
            "earlier checkpoint, or pass allow_nonfinite=True to take them as they are"
        )
