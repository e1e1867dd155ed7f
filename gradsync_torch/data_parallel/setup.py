"""``DataParallel``'s construction, in the order it runs: resolve the groups, plan the
layout, agree across ranks and start from rank 0's state (docs/design.md §6, §8).

Each step is a function of what it needs and returns a value; the wrapper only stores the
results. Nothing here runs during a step.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._agreement import state_entries, verify_same_everywhere
from gradsync_torch._collectives import broadcast_tensors
from gradsync_torch._specs import named_parameters, param_specs
from gradsync_torch.data_parallel.buckets import make_plan
from gradsync_torch.data_parallel.grad_sharding import pad_for_sharding
from gradsync_torch.model_parallel.groups import ProcessGroups
from gradsync_torch.model_parallel.layers import expert_parameter_names, shared_param_specs


class GroupChoice(NamedTuple):
    """The groups DataParallel reduces over."""

    process_group: dist.ProcessGroup | None  # data-parallel; None: the world
    shared_plan: gradsync_core.ReductionPlan | None  # model-parallel sums after the mean


class Layout(NamedTuple):
    """What DataParallel plans from the module before talking to any other rank."""

    specs: list[gradsync_core.ParamSpec]  # every parameter, frozen ones too
    trainable: list[tuple[str, nn.Parameter]]  # position = slot
    frozen: list[nn.Parameter]
    plan: gradsync_core.BucketPlan


def resolve_groups(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None,
    groups: ProcessGroups | None,
    shared_plan: gradsync_core.ReductionPlan | None,
    shard_gradients: bool,
) -> GroupChoice:
    """DataParallel's group arguments: the data-parallel group and the shared-sum plan.

    With ``groups`` the data-parallel group is ``groups["dp"]`` and, unless ``shared_plan``
    is given, the plan is derived from the layers' sharding declarations (docs/design.md §6).
    A dp axis of size 1 has no process group in ``ProcessGroups``; DataParallel still needs
    one (its checks and buffers), so it gets this rank alone, created locally (no other rank
    takes part, so ranks of other dp groups need not call it).

    Raises:
        TypeError: if ``groups`` or ``shared_plan`` has the wrong type.
        ValueError: on conflicting arguments, a model whose sums cannot be derived, or
            ``shard_gradients`` with model-parallel sums.
    """
    if groups is None:
        experts = sorted(expert_parameter_names(module))
        if experts:
            raise ValueError(
                f"the model has expert parameters ({experts[0]!r} and {len(experts) - 1} more), "
                "whose gradients are averaged over the expert data-parallel group, not over "
                "process_group; pass groups=ProcessGroups(Topology.create(world_size, ep=...))"
            )
        if shared_plan is not None:
            raise ValueError(
                "shared_plan needs groups=: pass the ProcessGroups the plan's reduction "
                "groups live in (DataParallel(model, groups=groups, shared_plan=plan))"
            )
        return GroupChoice(process_group, None)
    if not isinstance(groups, ProcessGroups):
        raise TypeError(
            f"groups must be a gradsync_torch.ProcessGroups, got {type(groups).__name__}"
        )
    if process_group is not None:
        raise ValueError(
            "pass process_group or groups, not both: with groups= the data-parallel group "
            "is groups['dp']"
        )
    if shared_plan is None:
        try:
            specs = shared_param_specs(module)
        except ValueError as err:
            raise ValueError(
                f"DataParallel(groups=...) derives the model-parallel gradient sums from the "
                f"model, but {err}; or pass shared_plan=plan_shared_reductions("
                "shared_param_specs(model, data_axes=...), groups.topology)"
            ) from None
        shared_plan = gradsync_core.plan_shared_reductions(specs, groups.topology)
    elif not isinstance(shared_plan, gradsync_core.ReductionPlan):
        raise TypeError(
            f"shared_plan must be a gradsync_core.ReductionPlan, got {type(shared_plan).__name__}"
        )
    if shard_gradients and shared_plan.reductions:
        raise ValueError(
            "shard_gradients=True cannot be combined with shared-parameter sums (here over "
            f"{list(shared_plan.group_names)}): after the reduce-scatter each rank holds only "
            "its shard of a bucket, and members of a model-parallel group may hold different "
            "buckets; use shard_gradients=False with model parallelism "
            "(ZeroRedundancyOptimizer still shards the optimizer state, ZeRO-1)"
        )
    broadcast_expert_parameters(module, groups)
    dp = groups.group("dp")
    if dp.size > 1:
        return GroupChoice(dp.process_group, shared_plan)
    alone = dist.new_group([dp.ranks[0]], use_local_synchronization=True)
    return GroupChoice(alone, shared_plan)


def broadcast_expert_parameters(module: nn.Module, groups: ProcessGroups) -> None:
    """Copy the expert weights of ``edp`` rank 0 to the rest of its ``edp`` group.

    The dense weights are broadcast over ``dp`` later (``verify_and_broadcast``), but the
    dense ``dp`` group spans ranks holding different experts, so expert weights are copied
    only between the ranks that hold the same experts.
    """
    names = expert_parameter_names(module)
    if not names or groups.size("edp") == 1:
        return
    edp = groups.group("edp")
    tensors = [p for name, p in named_parameters(module) if name in names]
    broadcast_tensors(tensors, edp.process_group)


def plan_layout(
    module: nn.Module,
    *,
    overlap: bool,
    bucket_cap_mb: float | None,
    shard_gradients: bool,
    world_size: int,
) -> Layout:
    """The module's parameters and the initial bucket plan (padded for sharding).

    Expert parameters (``gradsync_expert_params``) are left out of the dense buckets: their
    gradients are reduced over ``edp`` by the shared plan (docs/design.md §6).
    """
    experts = expert_parameter_names(module)
    named = [(name, p) for name, p in named_parameters(module) if name not in experts]
    specs = param_specs(named)
    plan = make_plan(specs, overlap=overlap, bucket_cap_mb=bucket_cap_mb)
    if shard_gradients:
        plan = pad_for_sharding(plan, world_size)
    return Layout(
        specs=specs,
        trainable=[(name, p) for name, p in named if p.requires_grad],
        frozen=[p for _, p in named if not p.requires_grad],
        plan=plan,
    )


def verify_and_broadcast(
    module: nn.Module,
    plan: gradsync_core.BucketPlan,
    options: dict[str, object],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Check every rank holds the same plan, parameters, buffers and options, then copy
    rank 0's weights and buffers everywhere (DDP's ``_sync_module_states``)."""
    verify_same_everywhere(plan, state_entries(module, options), group, device)
    experts = expert_parameter_names(module)  # broadcast over edp by resolve_groups
    tensors = [p for name, p in named_parameters(module) if name not in experts]
    tensors += [b for _, b in module.named_buffers()]
    broadcast_tensors(tensors, group)


def check_still_frozen(frozen: list[nn.Parameter], module: nn.Module) -> None:
    """Before a training forward: no parameter frozen at construction requires grad now.

    Raises:
        RuntimeError: naming the parameter (its gradient would never be synced).
    """
    for p in frozen:
        if p.requires_grad:
            name = next(n for n, q in named_parameters(module) if q is p)
            raise RuntimeError(
                f"parameter {name!r} was frozen when DataParallel was built and now "
                "requires grad, so its gradient would never be synced; wrap the model "
                "again after changing requires_grad"
            )
