"""ParamSpecs from a torch module: the only place torch facts enter the planner."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from gradsync_core import ParamSpec


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling gradsync_core and NumPy use)."""
    return str(dtype).removeprefix("torch.")


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` in registration order, tied parameters once (the first
    name wins, as in torch), frozen ones included."""
    return list(module.named_parameters(remove_duplicate=True))


def param_specs(
    named: nn.Module | Iterable[tuple[str, torch.Tensor]],
    *,
    replicated_over: dict[str, tuple[str, ...]] | None = None,
) -> list[ParamSpec]:
    """One ParamSpec per distinct parameter, in registration order.

    Args:
        named: a module, or ``(name, tensor)`` pairs such as ``module.named_parameters()``.
        replicated_over: model-parallel axes per parameter name (docs/design.md §6).

    Example:
        >>> [s.name for s in param_specs(nn.Linear(3, 2))]
        ['weight', 'bias']
    """
    pairs = named_parameters(named) if isinstance(named, nn.Module) else list(named)
    extra = replicated_over or {}
    return [
        ParamSpec(
            name=name,
            shape=tuple(p.shape),
            dtype=dtype_name(p.dtype),
            requires_grad=p.requires_grad,
            device=p.device.type,
            replicated_over=extra.get(name, ()),
        )
        for name, p in pairs
    ]
