"""Optimizer values as checkpoint JSON, and back (docs/checkpoints.md).

A checkpoint stores hyper-parameters (``lr``, ``betas``) and 0-d state (Adam's ``step``) as
JSON numbers in its manifest, where gradsync_jax reads them too; loading gives each value back
in the type the optimizer holds now (a tuple, a 0-d tensor on its device).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from gradsync_torch._optim_state import NOT_HYPER


def to_json(value: Any, what: str) -> Any:
    """A hyper-parameter or 0-d state value as JSON (0-d tensors become numbers).

    Raises:
        ValueError: naming ``what`` if the value is not a number, string or tuple of them.
    """
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, tuple | list):
        return [to_json(v, what) for v in value]
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    raise ValueError(f"cannot save {what} = {value!r}: not a number, string or tuple of them")


def from_json(value: Any, current: Any) -> Any:
    """A saved hyper-parameter in the type the optimizer holds now (tuples, 0-d tensors)."""
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(from_json(v, c) for v, c in zip(value, current, strict=False))
    if torch.is_tensor(current) and not torch.is_tensor(value):
        return torch.tensor(value, dtype=current.dtype, device=current.device)
    return value


def groups_json(
    param_groups: Sequence[dict[str, Any]], names: Sequence[str]
) -> list[dict[str, Any]]:
    """Param groups as JSON: hyper-parameters, and the names of their parameters."""
    out, first = [], 0
    for g, group in enumerate(param_groups):
        entry = {
            k: to_json(v, f"hyper-parameter {k!r} of param group {g}")
            for k, v in group.items()
            if k not in NOT_HYPER
        }
        entry["params"] = list(names[first : first + len(group["params"])])
        first += len(group["params"])
        out.append(entry)
    return out
