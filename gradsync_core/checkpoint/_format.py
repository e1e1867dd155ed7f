"""The optimizer-checkpoint format shared by the torch and JAX executors (docs/design.md §9).

A checkpoint is a directory::

    manifest.json                        written last, atomically; names every file below
    rank-00000-of-00004.safetensors      one per rank: "<param name>/<state key>" -> tensor,
                                         and "__model__/<param name>" -> weight when saved

State is stored per parameter in model space, so loading at another world size is only a new
partition: each rank reads the tensors it now owns. Tensor I/O (safetensors) lives in the
executors, reading and writing the directory in ``_storage``; this module holds the format as
plain data: the names, the manifest and its field checks.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from gradsync_core.checkpoint._data_position import DATA_KEY, check_data_position
from gradsync_core.checkpoint._layout import LAYOUT, check_layout_record
from gradsync_core.plan._canonical import fingerprint
from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._specs import ParamSpec, check_unique_names

FORMAT = "gradsync-optimizer-checkpoint"
# 2: framework-neutral (torch names, layouts and state keys; 0-d state as JSON numbers in
# extra["scalars"]), read by both executors. 1: each framework's own names; read by the
# executor that wrote it.
FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST = "manifest.json"
# A manifest larger than this is not one gradsync wrote (about 200 bytes per parameter plus
# its shards), and reading it whole would cost its size in memory twice.
MAX_MANIFEST_BYTES = 256 << 20
FRAMEWORKS = ("torch", "jax")
_REQUIRED = ("framework", "optimizer", "world_size", "step", "params", "plan", "state_keys")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


# Matches every name ``rank_file`` produces (and nothing else a save writes).
RANK_FILE_RE = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")


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
    optimizer: str  # e.g. "torch.optim.Adam"; "adam" (a canonical name, gradsync_jax)
    world_size: int
    step: int
    params: tuple[ParamSpec, ...]
    plan: ShardPlan
    state_keys: Mapping[str, tuple[str, ...]]  # param name -> its state keys
    files: Mapping[str, str]  # rank file -> sha256
    extra: Mapping[str, Any] = field(default_factory=dict)  # hyper-parameters, param groups
    version: int = FORMAT_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": self.version,
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
        """Build a manifest from its JSON, checking every field before anything is loaded.

        A manifest that parses but holds ``"step": "seven"``, a string learning rate or a
        parameter without state keys would otherwise fail much later, inside the
        optimizer's step; here it fails at once (docs/design.md §9).

        Raises:
            ValueError: one sentence naming the field, the value seen and what was expected.
        """
        if not isinstance(obj, Mapping) or obj.get("format") != FORMAT:
            raise ValueError("not a gradsync optimizer checkpoint manifest")
        if obj.get("version") not in READABLE_VERSIONS:
            raise ValueError(
                f"checkpoint format version {obj.get('version')!r} is not one of "
                f"{list(READABLE_VERSIONS)}, the versions this gradsync reads; load it with the "
                "gradsync that wrote it and save it again"
            )
        for key in (*_REQUIRED, "files"):
            if key not in obj:
                raise ValueError(f"manifest field {key!r} is missing; restore it or save again")
        if obj["framework"] not in FRAMEWORKS:
            _refuse("framework", obj["framework"], f"one of {list(FRAMEWORKS)}")
        if not isinstance(obj["optimizer"], str) or not obj["optimizer"]:
            _refuse("optimizer", obj["optimizer"], "a class name such as 'torch.optim.Adam'")
        world_size, step = obj["world_size"], obj["step"]
        if not _is_int(world_size) or world_size < 1:
            _refuse("world_size", world_size, "an int >= 1")
        if not _is_int(step) or step < 0:
            _refuse("step", step, "an int >= 0")
        params = _params(obj["params"])
        return cls(
            framework=obj["framework"],
            optimizer=obj["optimizer"],
            world_size=world_size,
            step=step,
            params=params,
            plan=_plan(obj["plan"], params, world_size),
            state_keys=_state_keys(obj["state_keys"], params),
            files=_files(obj["files"], world_size),
            extra=_extra(obj.get("extra", {}), obj["state_keys"], world_size),
            version=obj["version"],
        )


def _refuse(field: str, value: Any, expected: str) -> NoReturn:
    text = repr(value)
    text = text if len(text) <= 80 else text[:77] + "..."
    raise ValueError(f"manifest field {field!r} is {text}, expected {expected}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_hyper(value: Any) -> bool:
    """A finite JSON number, bool or null, or a list of them (Adam's ``betas``): a NaN or
    infinite learning rate (Python's JSON reads ``NaN``) would turn every weight into NaN at
    the first step."""
    if isinstance(value, list):
        return all(_is_hyper(v) and not isinstance(v, list) for v in value)
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, bool | int)


def _params(value: Any) -> tuple[ParamSpec, ...]:
    if not isinstance(value, list):
        _refuse("params", value, "a list of parameter objects")
    specs = []
    for i, entry in enumerate(value):
        try:
            specs.append(ParamSpec.from_json(entry))
        except (ValueError, TypeError) as e:
            raise ValueError(f"manifest field 'params[{i}]': {e}") from None
    try:
        check_unique_names(specs)
    except ValueError as e:
        raise ValueError(f"manifest field 'params': {e}") from None
    return tuple(specs)


def _plan(value: Any, params: tuple[ParamSpec, ...], world_size: int) -> ShardPlan:
    try:
        plan = ShardPlan.from_json(value)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        _refuse("plan", value, f"a shard plan as ShardPlan.to_json writes it ({e!r})")
    if plan.world_size != world_size:
        _refuse("plan.world_size", plan.world_size, f"world_size = {world_size}")
    numel = {p.name: p.numel for p in params}
    for shard in plan.shards:
        if shard.name not in numel:
            _refuse("plan.shards", shard.name, "the name of a parameter listed in 'params'")
        in_range = all(_is_int(v) for v in (shard.rank, shard.start, shard.stop, shard.group))
        if not (in_range and 0 <= shard.rank < world_size):
            _refuse(f"plan.shards[{shard.name!r}].rank", shard.rank, f"0 <= rank < {world_size}")
        if not 0 <= shard.start <= shard.stop <= numel[shard.name]:
            _refuse(
                f"plan.shards[{shard.name!r}]",
                (shard.start, shard.stop),
                f"0 <= start <= stop <= {numel[shard.name]} (the parameter's numel)",
            )
    return plan


def _state_keys(value: Any, params: tuple[ParamSpec, ...]) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        _refuse("state_keys", value, "an object mapping parameter names to lists of state keys")
    names = {p.name for p in params}
    for name, keys in value.items():
        if name not in names:
            _refuse("state_keys", name, "the name of a parameter listed in 'params'")
        if (
            not isinstance(keys, list)
            or not all(isinstance(k, str) and k for k in keys)
            or len(set(keys)) != len(keys)
        ):
            _refuse(f"state_keys[{name!r}]", keys, 'a list of distinct names like ["exp_avg"]')
    # An empty mapping is a stateless optimizer (SGD without momentum) or a save before the
    # first step; otherwise a trainable parameter without an entry was dropped.
    if value:
        for p in params:
            if p.requires_grad and p.name not in value:
                _refuse("state_keys", f"<no entry for {p.name!r}>", "one entry per trainable param")
    return {name: tuple(keys) for name, keys in value.items()}


def _files(value: Any, world_size: int) -> dict[str, str]:
    if not isinstance(value, Mapping):
        _refuse("files", value, "an object mapping rank files to sha256 digests")
    for name, digest in value.items():
        if not isinstance(name, str) or not RANK_FILE_RE.fullmatch(name):
            _refuse("files", name, "a rank file name like 'rank-00000-of-00004.safetensors'")
        if not isinstance(digest, str) or not _SHA256_HEX.fullmatch(digest):
            _refuse(f"files[{name!r}]", digest, "a sha256 digest of 64 lowercase hex digits")
    # Count first: a forged world_size of 10**12 must not build a set of 10**12 names.
    if len(value) != world_size or set(value) != {
        rank_file(r, world_size) for r in range(world_size)
    }:
        _refuse("files", sorted(value)[:3], f"exactly one file per rank of {world_size}")
    return dict(value)


def _extra(value: Any, state_keys: Mapping[str, Sequence[str]], world_size: int) -> dict[str, Any]:
    """Check the entries the executors read back: torch's param groups and scalars, JAX's
    partition and global keys, the model weights' owners. Other entries are kept as they
    are."""
    if not isinstance(value, Mapping):
        _refuse("extra", value, "a JSON object")
    groups = value.get("param_groups", [])
    if not isinstance(groups, list) or not all(isinstance(g, Mapping) for g in groups):
        _refuse("extra.param_groups", groups, "a list of param-group objects")
    for i, group in enumerate(groups):
        for key, hyper in group.items():
            if key == "params":
                if not isinstance(hyper, list) or not all(isinstance(n, str) for n in hyper):
                    _refuse(f"extra.param_groups[{i}].params", hyper, "a list of names")
            elif not _is_hyper(hyper):
                _refuse(
                    f"extra.param_groups[{i}].{key}",
                    hyper,
                    "a number, bool or null; numbers finite",
                )
    scalars = value.get("scalars", {})
    if not isinstance(scalars, Mapping):
        _refuse("extra.scalars", scalars, "an object of state values")
    listed = {tensor_key(name, key): key for name, keys in state_keys.items() for key in keys}
    for key, scalar in scalars.items():
        if key not in listed:
            _refuse("extra.scalars", key, "'<param>/<state key>' of a key in 'state_keys'")
        if not _is_hyper(scalar):
            _refuse(f"extra.scalars[{key!r}]", scalar, "a number, bool or null; numbers finite")
        # A step count below 0 divides by zero in Adam's bias correction (1 - beta ** 0).
        if listed[key] == "step" and not (isinstance(scalar, int | float) and scalar >= 0):
            _refuse(f"extra.scalars[{key!r}]", scalar, "a step count >= 0")
    if not isinstance(value.get("shard_gradients", False), bool):
        _refuse("extra.shard_gradients", value["shard_gradients"], "true or false")
    if not isinstance(value.get("partition", ""), str):
        _refuse("extra.partition", value["partition"], "a partition name such as 'flat'")
    global_keys = value.get("global_keys", [])
    if not isinstance(global_keys, list) or not all(isinstance(k, str) for k in global_keys):
        _refuse("extra.global_keys", global_keys, "a list of state paths")
    hyperparams = value.get("hyperparams", {})  # what a JAX save's Optax computes
    if not isinstance(hyperparams, Mapping):
        _refuse("extra.hyperparams", hyperparams, "an object of hyper-parameters")
    for key, hyper in hyperparams.items():
        if not _is_hyper(hyper):
            _refuse(f"extra.hyperparams.{key}", hyper, "a number, bool or null; numbers finite")
    if DATA_KEY in value:
        check_data_position(value[DATA_KEY])  # the sampler's cursor (_data_position.py)
    if LAYOUT in value:
        check_layout_record(value[LAYOUT])  # the layout it was saved under (_layout.py)
    model = value.get("model", {})
    if not isinstance(model, Mapping):
        _refuse("extra.model", model, "an object mapping parameter names to ranks")
    for name, rank in model.items():
        if not (isinstance(name, str) and name and _is_int(rank) and 0 <= rank < world_size):
            _refuse(f"extra.model[{name!r}]", rank, f"a rank file's rank, 0 to {world_size - 1}")
    return dict(value)


def manifest_checksum(obj: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of every manifest field except ``"checksum"``."""
    return fingerprint({k: v for k, v in obj.items() if k != "checksum"})


def rank_file_metadata(rank: int, world_size: int) -> dict[str, str]:
    """What a rank file records about itself in its safetensors metadata (both executors
    write it; ``check_rank_file`` reads it back)."""
    return {"rank": str(rank), "world": str(world_size)}
