"""The tensors of a checkpoint's rank files in model space, read by the element ranges a load
keeps (docs/checkpoints.md).

``StoredFiles`` reads every rank file's header (bounded) and locates each model-space tensor
``"<name>/<key>"``: per the manifest's plan, whole in one file (greedy) or as flat slices across
files (flat, dim0), or whole where a file holds it (version 1, Optax's global leaves). Its
stand-ins (arrays of the shape and dtype, holding no data) let every check of shapes and
dtypes run before any tensor is read; ``window`` then reads elements ``[start, stop)`` of a
flattened tensor from the files that hold them (``gradsync_core.checkpoint.state_reads``,
``weight_reads``), so a load that keeps only some rows reads only those.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
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
        self._where: dict[str, str | None] = {}  # model-space key -> its file, or None: plan

    def __enter__(self) -> StoredFiles:
        return self

    def __exit__(self, *_: Any) -> None:
        for f in self._open.values():
            f.close()
        self._open.clear()

    def state(self) -> dict[str, np.ndarray]:
        """Stand-ins of every model-space state tensor the files hold, by ``"<name>/<key>"``:
        a whole stored tensor's shape, or for flat slices the parameter's shape (once every
        slice was found with its length and one dtype); Optax's global leaves as stored.

        Raises:
            ValueError: naming a tensor that lacks a slice in a rank file or has a slice of
                another length or dtype.
        """
        plan = self.manifest.plan
        shapes = {spec.name: spec.shape for spec in self.manifest.params}
        out: dict[str, np.ndarray] = {}
        for file, entries in self.entries.items():
            for key, entry in entries.items():
                pseudo = key.partition("/")[0]
                if key in out or pseudo == MODEL_PARAM:
                    continue
                name = key.rpartition("/")[0]
                shards = [s for s in plan.shards if s.name == name and s.stop > s.start]
                if pseudo == GLOBAL_PARAM or self.manifest.version == 1 or not shards:
                    self._where[key] = file  # whole where it is
                    out[key] = entry.stand_in()
                elif plan.kind == "greedy":
                    owner = rank_file(shards[0].rank, plan.world_size)
                    owned = self.entries[owner].get(key)
                    if owned is None:
                        raise ValueError(
                            f"checkpoint tensor {key!r} is not in {owner}, which the plan says "
                            "holds it"
                        )
                    self._where[key] = None
                    out[key] = owned.stand_in()
                else:
                    out[key] = self._slices(key, shards, shapes[name])
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
        self._where[key] = None
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

    def window(self, key: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of the flattened model-space state tensor ``key`` (one
        that ``state`` located), read from the files that hold them."""
        file = self._where[key]
        if file is not None:  # whole in one file: element e of the tensor at e
            return self._read(file, key, start, stop)
        name, _, state_key = key.rpartition("/")
        window = Window(name=name, start=start, stop=stop)
        return self._fill(window, state_reads(self.manifest.plan, [window], {name: [state_key]}))

    def weight_window(self, name: str, start: int, stop: int) -> np.ndarray:
        """Elements ``[start, stop)`` of model weight ``name``, flattened (torch layout)."""
        window = Window(name=name, start=start, stop=stop)
        owners = self.manifest.extra.get("model", {})
        return self._fill(window, weight_reads(owners, self.manifest.world_size, [window]))

    def whole(self, key: str, shape: tuple[int, ...]) -> np.ndarray:
        """The model-space state tensor ``key`` whole, as ``shape`` (its stand-in's)."""
        return self.window(key, 0, int(np.prod(shape, dtype=np.int64))).reshape(shape)

    def _fill(self, window: Window, reads: Iterable[WindowRead]) -> np.ndarray:
        parts = [
            (read, self._read(read.file, read.keys[0], read.start, read.stop)) for read in reads
        ]
        out = np.empty(window.numel, parts[0][1].dtype)
        for read, part in parts:
            out[read.at : read.at + read.numel] = part
        return out

    def _read(self, file: str, key: str, start: int, stop: int) -> np.ndarray:
        path = os.path.join(self.directory, file)
        f = self._open.get(file)
        if f is None:
            f = self._open[file] = open_checkpoint_file(self.directory, file)
        return read_elements(f, path, key, self.entries[file][key], start, stop)


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
