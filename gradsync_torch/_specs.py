"""ParamSpecs from a torch module: the only place torch facts enter the planner.

Besides shapes and dtypes, that is the layers' sharding declarations
(``gradsync_sharded_over``): which axes split a parameter (tensor parallelism, experts), from
which ``replicated_over`` and ``shared_param_specs`` derive what the shared sums reduce.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import cast

import torch
from torch import nn

from gradsync_core import ParamSpec, replicated_axes
from gradsync_core.checkpoint import is_wrapped


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (the spelling gradsync_core and NumPy use)."""
    return str(dtype).removeprefix("torch.")


def named_parameters(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``module.named_parameters()`` in registration order, tied parameters once (the first
    name wins, as in torch), frozen ones included."""
    return list(module.named_parameters(remove_duplicate=True))


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside data-parallel wrappers (DDP, ``nn.DataParallel``, gradsync's
    ``DataParallel``): ``model.module`` while every parameter name is under ``module.``, so
    a checkpoint never stores wrapper names (``gradsync_core.checkpoint.unwrapped_names``)."""
    while isinstance(getattr(module, "module", None), nn.Module) and is_wrapped(
        [name for name, _ in module.named_parameters()]
    ):
        module = cast(nn.Module, module.module)
    return module


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


def read_model(model: object) -> tuple[list[ParamSpec], tuple[str, ...]] | None:
    """The specs of a torch module and the names of its tied weights, for the command line's
    ``gradsync plan --model`` (its ``gradsync.model_readers`` entry point); ``None`` for
    anything that is not an ``nn.Module``.

    A tied weight (one parameter under two names) is listed under its first name, as
    ``param_specs`` lists it.
    """
    if not isinstance(model, nn.Module):
        return None
    first: dict[int, str] = {}
    tied: dict[str, None] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            tied[first[id(param)]] = None
        first.setdefault(id(param), name)
    return param_specs(model), tuple(tied)


EXPERT_AXIS = "ep"


def param_sharded_over(param: torch.Tensor) -> tuple[str, ...]:
    """The axes a parameter declares itself split over (``param.gradsync_sharded_over``)."""
    return tuple(getattr(param, "gradsync_sharded_over", ()))


def is_expert(param: torch.Tensor) -> bool:
    """Whether ``param`` is an expert weight: declared split over ``"ep"`` (as JAX derives
    it from a ``PartitionSpec``). ``DataParallel`` and ``ZeroRedundancyOptimizer`` both ask
    this, so one declaration serves both (docs/model-parallel.md, "Experts")."""
    return EXPERT_AXIS in param_sharded_over(param)


def sharded_over(module: nn.Module) -> dict[int, tuple[str, ...]]:
    """The declared sharding of ``module``'s parameters, by ``id(param)``.

    Two spellings of the one attribute: a layer's ``gradsync_sharded_over`` maps its
    parameter names to axes (the parallel linears: ``{"weight": ("tp",)}``, which survives
    ``copy.deepcopy``); a parameter's own ``gradsync_sharded_over`` holds its axes, which is
    how expert weights declare ``("ep",)``, since ``ZeroRedundancyOptimizer`` sees parameters
    without their module.

    Raises:
        ValueError: if a layer declares ``"ep"`` by name (the optimizer could not see it).
    """
    declared: dict[int, tuple[str, ...]] = {}
    for sub in module.modules():
        for name, axes in getattr(sub, "gradsync_sharded_over", {}).items():
            if EXPERT_AXIS in axes:
                raise ValueError(
                    f"{type(sub).__name__} declares {name!r} split over {tuple(axes)} in its "
                    "gradsync_sharded_over; declare expert weights on the parameter instead "
                    f"(self.{name}.gradsync_sharded_over = ('ep',)) so that "
                    "ZeroRedundancyOptimizer, which sees parameters without their module, "
                    "plans them as experts too"
                )
            param = getattr(sub, name)
            if param is not None:
                declared[id(param)] = tuple(axes)
        for param in sub.parameters(recurse=False):
            if param_sharded_over(param):
                declared[id(param)] = param_sharded_over(param)
    return declared


def replicated_over(
    module: nn.Module, *, data_axes: Sequence[str] | None = None
) -> dict[str, tuple[str, ...]]:
    """Each parameter's replicated model-parallel axes, derived, never hand-marked.

    Args:
        module: the model; sharded parameters are declared by their layers'
            ``gradsync_sharded_over`` (``{"weight": ("tp",)}``), all others are unsharded.
        data_axes: the axes that split the model's tokens; default
            ``module.gradsync_data_axes``.

    Returns:
        ``{name: axes}`` for every parameter (``named_parameters`` order, tied ones once).

    Raises:
        ValueError: if ``data_axes`` is not given and the module does not declare it.
    """
    if data_axes is None:
        data_axes = getattr(module, "gradsync_data_axes", None)
        if data_axes is None:
            raise ValueError(
                f"{type(module).__name__} does not declare gradsync_data_axes; pass "
                "data_axes=, the axes its tokens are split over: ('cp',) under context "
                "parallelism, ('cp', 'tp') with sequence parallelism, () otherwise"
            )
    sharded = sharded_over(module)
    return {
        name: replicated_axes(sharded_over=sharded.get(id(p), ()), data_sharded_over=data_axes)
        for name, p in named_parameters(module)
    }


def shared_param_specs(
    module: nn.Module, *, data_axes: Sequence[str] | None = None
) -> list[ParamSpec]:
    """``param_specs(module)`` with ``replicated_over`` derived by ``replicated_over`` and
    ``expert`` set for the parameters declared split over ``"ep"`` (``is_expert``).

    Feed it to ``gradsync_core.plan_shared_reductions`` (and to the data-parallel plan).

    Example:
        >>> specs = shared_param_specs(model)  # model.gradsync_data_axes == ("cp",)
        >>> [s.replicated_over for s in specs if s.name == "norm.weight"]
        [('cp',)]
    """
    named = named_parameters(module)
    axes = replicated_over(module, data_axes=data_axes)
    specs = param_specs(named, replicated_over=axes)
    return [replace(spec, expert=is_expert(p)) for spec, (_, p) in zip(specs, named, strict=True)]
