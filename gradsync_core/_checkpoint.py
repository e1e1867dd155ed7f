"""The optimizer-checkpoint format shared by the torch and JAX executors (docs/design.md §9).

A checkpoint is a directory::

    manifest.json                        written last, atomically; names every file below
    rank-00000-of-00004.safetensors      one per rank: "<param name>/<state key>" -> tensor

State is stored per parameter in model space, so loading at another world size is only a new
partition: each rank reads the tensors it now owns. Tensor I/O (safetensors) lives in the
executors; this module holds everything that is plain data.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync_core._shards import ShardPlan
from gradsync_core._specs import ParamSpec

FORMAT = "gradsync-optimizer-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"

# The one place torch and Optax state names meet: torch.optim key -> optax field.
TORCH_TO_OPTAX_STATE = {
    "exp_avg": "mu",
    "exp_avg_sq": "nu",
    "step": "count",
    "momentum_buffer": "trace",
}
OPTAX_TO_TORCH_STATE = {v: k for k, v in TORCH_TO_OPTAX_STATE.items()}


# Matches every name ``rank_file`` produces (and nothing else a save writes).
RANK_FILE_RE = re.compile(r"rank-\d{5}-of-\d{5}\.safetensors")


def rank_file(rank: int, world_size: int) -> str:
    """``"rank-00001-of-00004.safetensors"``: the file that holds one rank's state."""
    return f"rank-{rank:05d}-of-{world_size:05d}.safetensors"


def tensor_key(param: str, state_key: str) -> str:
    """``"layers.0.weight/exp_avg"``: how a state tensor is named inside a rank file."""
    return f"{param}/{state_key}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    """What a checkpoint holds; enough to refuse a mismatched load before touching state."""

    framework: str  # "torch" | "jax"
    optimizer: str  # e.g. "torch.optim.Adam", "optax.adam"
    world_size: int
    step: int
    params: tuple[ParamSpec, ...]
    plan: ShardPlan
    state_keys: Mapping[str, tuple[str, ...]]  # param name -> its state keys
    files: Mapping[str, str]  # rank file -> sha256
    extra: Mapping[str, Any] = field(default_factory=dict)  # hyper-parameters, param groups

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "framework": self.framework,
            "optimizer": self.optimizer,
            "world_size": self.world_size,
            "step": self.step,
            "params": [p.to_json() for p in self.params],
            "plan": self.plan.to_json(),
            "state_keys": {k: list(v) for k, v in self.state_keys.items()},
            "files": dict(self.files),
            "extra": dict(self.extra),
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Manifest:
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            raise ValueError("not a gradsync optimizer checkpoint manifest")
        if obj.get("version") != FORMAT_VERSION:
            raise ValueError(
                f"checkpoint format version {obj.get('version')!r} is not {FORMAT_VERSION}, "
                "the version this gradsync reads"
            )
        return cls(
            framework=obj["framework"],
            optimizer=obj["optimizer"],
            world_size=obj["world_size"],
            step=obj["step"],
            params=tuple(ParamSpec.from_json(p) for p in obj["params"]),
            plan=ShardPlan.from_json(obj["plan"]),
            state_keys={k: tuple(v) for k, v in obj["state_keys"].items()},
            files=dict(obj["files"]),
            extra=dict(obj.get("extra", {})),
        )


def check_compatible(manifest: Manifest, params: Sequence[ParamSpec], *, optimizer: str) -> None:
    """Refuse a checkpoint of another model or optimizer, naming the first difference.

    The world size may differ (that is resharding); names, shapes, dtypes and which
    parameters are trainable must not.

    Raises:
        ValueError: one sentence saying what differs and how to fix it.
    """
    if manifest.optimizer != optimizer:
        raise ValueError(
            f"checkpoint was written by optimizer {manifest.optimizer!r}, this one is "
            f"{optimizer!r}; load it with the same optimizer class"
        )
    saved = {p.name: p for p in manifest.params if p.requires_grad}
    mine = {p.name: p for p in params if p.requires_grad}
    for name, spec in mine.items():
        if name not in saved:
            raise ValueError(f"checkpoint has no state for parameter {name!r}: another model?")
        if (spec.shape, spec.dtype) != (saved[name].shape, saved[name].dtype):
            raise ValueError(
                f"parameter {name!r} is {spec.shape} {spec.dtype} here but "
                f"{saved[name].shape} {saved[name].dtype} in the checkpoint: another model?"
            )
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise ValueError(
            f"checkpoint holds state for {len(extra)} parameter(s) this model lacks, "
            f"starting with {extra[0]!r}: another model?"
        )


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_atomic(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it into place, so a reader
    sees the old file or the new one, never half of one."""
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_manifest(directory: str | os.PathLike[str], manifest: Manifest) -> None:
    text = json.dumps(manifest.to_json(), indent=1, sort_keys=True)
    write_atomic(os.path.join(directory, MANIFEST), text.encode("utf-8"))


def read_manifest(directory: str | os.PathLike[str], *, verify_files: bool = True) -> Manifest:
    """Read and check a checkpoint's manifest (and, by default, every rank file's hash).

    Raises:
        ValueError: if the manifest is missing, unreadable, or a file is missing or corrupt.
    """
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            manifest = Manifest.from_json(json.load(f))
    except FileNotFoundError:
        raise ValueError(
            f"{directory!s} has no {MANIFEST}: not a gradsync checkpoint, or its save did "
            "not finish"
        ) from None
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is corrupt ({e}); restore it or save again") from None
    if verify_files:
        verify_file_hashes(directory, manifest)
    return manifest


def verify_file_hashes(
    directory: str | os.PathLike[str], manifest: Manifest, files: Sequence[str] | None = None
) -> None:
    """Check rank files against the sha256 the manifest recorded for them.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest, as returned by ``read_manifest``.
        files: the rank files to check (default: every file the manifest lists). A rank that
            reads only some files can check those plus its share of the rest, so that together
            the ranks check every file once.

    Raises:
        ValueError: naming the first file that is missing, unlisted or does not match.
    """
    for name in manifest.files if files is None else files:
        file_path = os.path.join(directory, name)
        if name not in manifest.files:
            raise ValueError(f"checkpoint file {file_path} is not listed in its manifest")
        if not os.path.exists(file_path):
            raise ValueError(f"checkpoint file {file_path} is missing")
        if sha256_file(file_path) != manifest.files[name]:
            raise ValueError(
                f"checkpoint file {file_path} does not match its manifest hash: corrupt or "
                "from another save"
            )
