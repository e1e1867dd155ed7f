"""Parameter specs: the planner's only input (docs/design.md §2)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# Bytes per element for the dtype names torch and JAX share. Names follow NumPy/JAX spelling
# ("float32", "bfloat16"); executors translate torch.float32 -> "float32".
DTYPE_ITEMSIZE: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
}


_JSON_KEY_ORDER = ("name", "shape", "dtype", "requires_grad", "device", "replicated_over", "expert")
_JSON_KEYS = frozenset(_JSON_KEY_ORDER)


def itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype``.

    Raises:
        ValueError: if the dtype name is unknown.
    """
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        known = ", ".join(sorted(DTYPE_ITEMSIZE))
        raise ValueError(f"unknown dtype {dtype!r}; use one of: {known}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamSpec:
    """What the planner needs to know about one parameter.

    Args:
        name: fully-qualified name, e.g. ``layers.0.attn.wq.weight`` (torch) or
            ``params/Dense_0/kernel`` (Flax).
        shape: the parameter's shape as this rank holds it.
        dtype: dtype name such as ``"float32"`` or ``"bfloat16"``.
        requires_grad: frozen parameters (``False``) get no bucket slot and no optimizer state.
        device: a placement tag (``"cpu"``, ``"cuda"``); buckets never mix devices.
        replicated_over: model-parallel axes (``"tp"``, ``"cp"``, ...) over which this parameter
            is replicated, so its gradient needs an extra sum over them (docs/design.md §6).
        expert: a mixture-of-experts expert weight, declared by its layer: its gradient is
            reduced over the expert data-parallel group ``edp``, not over ``dp``
            (Megatron-core's expert generator, docs/design.md §5).

    Example:
        >>> ParamSpec(name="fc.weight", shape=(4, 3)).numel
        12
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    requires_grad: bool = True
    device: str = "cpu"
    replicated_over: tuple[str, ...] = ()
    expert: bool = False
    # Derived once: planners read it several times per parameter, for 10^5 parameters.
    numel: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"a parameter needs a non-empty string name, got {self.name!r}")
        shape = tuple(self.shape)
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(
                f"parameter {self.name!r} has shape {self.shape!r}; "
                "every dimension must be a non-negative int"
            )
        itemsize(self.dtype)  # validates the name
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "replicated_over", tuple(self.replicated_over))
        object.__setattr__(self, "numel", math.prod(shape))

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "requires_grad": self.requires_grad,
            "device": self.device,
            "replicated_over": list(self.replicated_over),
        } | ({"expert": True} if self.expert else {})  # absent: dense, as before experts

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ParamSpec:
        """Build a spec from a JSON object; only ``name`` and ``shape`` are required.

        Types are checked as JSON has them, so ``"requires_grad": "no"`` is refused rather
        than read as true: ``name`` a non-empty string, ``shape`` a list of non-negative
        ints, ``dtype`` a name from ``DTYPE_ITEMSIZE``, ``requires_grad`` true or false,
        ``device`` a string, ``replicated_over`` a list of strings and ``expert`` true or false.

        Raises:
            ValueError: naming the field, the value seen and what it should be.
        """
        if not isinstance(obj, Mapping):
            raise ValueError(f"a parameter entry must be a JSON object, got {_short(obj)}")
        unknown = set(obj) - _JSON_KEYS
        if unknown:
            raise ValueError(
                f"parameter entry {_short(obj)} has unknown keys {sorted(unknown)}; the valid "
                f"keys are {', '.join(_JSON_KEY_ORDER)} (only name and shape are required)"
            )
        if "name" not in obj or "shape" not in obj:
            raise ValueError(f"parameter entry {_short(obj)} needs at least 'name' and 'shape'")
        name = obj["name"]
        if not isinstance(name, str) or not name:
            raise ValueError(f"a parameter's 'name' must be a non-empty string, got {_short(name)}")
        shape = obj["shape"]
        if not isinstance(shape, list | tuple) or not all(_is_size(d) for d in shape):
            raise ValueError(
                f"parameter {name!r}: 'shape' must be a list of non-negative ints, "
                f"got {_short(shape)}"
            )
        dtype = obj.get("dtype", "float32")
        if not isinstance(dtype, str):
            raise ValueError(f"parameter {name!r}: 'dtype' must be a string, got {_short(dtype)}")
        requires_grad = obj.get("requires_grad", True)
        if not isinstance(requires_grad, bool):
            raise ValueError(
                f"parameter {name!r}: 'requires_grad' must be true or false, "
                f"got {_short(requires_grad)}"
            )
        device = obj.get("device", "cpu")
        if not isinstance(device, str) or not device:
            raise ValueError(
                f"parameter {name!r}: 'device' must be a non-empty string, got {_short(device)}"
            )
        replicated_over = obj.get("replicated_over", [])
        if not isinstance(replicated_over, list | tuple) or not all(
            isinstance(axis, str) for axis in replicated_over
        ):
            raise ValueError(
                f"parameter {name!r}: 'replicated_over' must be a list of axis names such as "
                f'["tp"], got {_short(replicated_over)}'
            )
        expert = obj.get("expert", False)
        if not isinstance(expert, bool):
            raise ValueError(
                f"parameter {name!r}: 'expert' must be true or false, got {_short(expert)}"
            )
        return cls(
            name=name,
            shape=tuple(shape),
            dtype=dtype,
            requires_grad=requires_grad,
            device=device,
            replicated_over=tuple(replicated_over),
            expert=expert,
        )


def _is_size(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value: object, limit: int = 80) -> str:
    """``repr`` cut to ``limit`` characters: an error line must stay one short line."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_unique_names(specs: Iterable[ParamSpec]) -> None:
    """Raise ``ValueError`` if two specs share a name (tied parameters must appear once)."""
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise ValueError(
                f"parameter {spec.name!r} appears twice; list tied parameters once "
                "(deduplicate by identity, as named_parameters() does)"
            )
        seen.add(spec.name)


def trainable(specs: Sequence[ParamSpec]) -> list[tuple[int, ParamSpec]]:
    """(registration index, spec) of every parameter that requires grad."""
    return [(i, s) for i, s in enumerate(specs) if s.requires_grad]
