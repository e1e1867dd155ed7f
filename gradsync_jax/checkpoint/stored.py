"""The tensors of a checkpoint's rank files, joined into model space (docs/checkpoints.md)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from gradsync_core import Manifest
from gradsync_core.checkpoint import MODEL_PARAM, rank_file
from gradsync_jax.checkpoint.safetensors_io import read_safetensors

GLOBAL_PARAM = "__optax__"  # the pseudo-parameter that carries global leaves


def read_rank_files(
    directory: str | os.PathLike[str], manifest: Manifest
) -> dict[tuple[int, str], Any]:
    """Every rank file's tensors by ``(rank, key)``."""
    tensors: dict[tuple[int, str], Any] = {}
    for rank in range(manifest.world_size):
        name = rank_file(rank, manifest.world_size)
        try:
            loaded = read_safetensors(os.path.join(directory, name))
        except Exception as err:  # a malformed header or a dtype this reader does not know
            raise ValueError(f"checkpoint file {name} cannot be read ({err})") from None
        tensors.update({(rank, key): value for key, value in loaded.items()})
    return tensors


def assemble(manifest: Manifest, tensors: dict[Any, np.ndarray]) -> dict[str, np.ndarray]:
    """Model-space tensors by ``"<name>/<key>"``: whole ones as stored, flat slices joined in
    element order and reshaped to the parameter."""
    shapes = {spec.name: spec.shape for spec in manifest.params}
    out: dict[str, np.ndarray] = {}
    pseudo = (GLOBAL_PARAM, MODEL_PARAM)  # not optimizer state of a parameter
    for rank, key in [k for k in tensors if k[1].partition("/")[0] not in pseudo]:
        if key in out:
            continue
        name = key.rpartition("/")[0]
        shards = sorted((s for s in manifest.plan.shards if s.name == name), key=lambda s: s.start)
        if manifest.plan.kind == "greedy" or manifest.version == 1:
            out[key] = tensors[(rank, key)]
            continue
        shards = [s for s in shards if s.stop > s.start]
        parts: list[Any] = [tensors.get((s.rank, key)) for s in shards]
        if any(p is None for p in parts):
            raise ValueError(f"checkpoint tensor {key!r} is missing a slice in some rank file")
        for shard, part in zip(shards, parts, strict=True):
            if part.shape != (shard.stop - shard.start,):  # before joining: a named sentence
                raise ValueError(
                    f"checkpoint tensor {key!r} is {part.shape} in "
                    f"{rank_file(shard.rank, manifest.world_size)}, expected "
                    f"({shard.stop - shard.start},) for elements [{shard.start}, {shard.stop})"
                )
        out[key] = np.concatenate([p.reshape(-1) for p in parts]).reshape(shapes[name])
    for (_, key), value in tensors.items():
        if key.partition("/")[0] == GLOBAL_PARAM:
            out[key] = value
    return out


def check_finite(tensors: Mapping[str, np.ndarray]) -> None:
    """Refuse a checkpoint whose state holds NaN or inf: loaded, the parameters would be NaN
    a step or two later (``load_optimizer_state`` and ``load_params`` take them with
    ``allow_nonfinite=True``).

    Raises:
        ValueError: naming the first such tensor.
    """
    for key, value in tensors.items():
        if value.dtype.kind in "biu":
            continue
        bad = int(np.size(value) - np.count_nonzero(np.isfinite(value.astype(np.float32))))
        if bad:
            raise ValueError(
                f"checkpoint tensor {key!r} holds {bad} NaN or infinite value(s); load an "
                "earlier checkpoint, or pass allow_nonfinite=True to take them as they are"
            )
