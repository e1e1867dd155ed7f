"""``DataParallel``'s construction steps, in the order they run.

Read the module's parameters once, resolve the groups, plan the layout, agree across ranks
and only then start from rank 0's state (docs/design.md §6, §8, §15).

Each step is a function of what it needs and returns a value; the wrapper only stores the
results. No collective runs before ``verify_same_everywhere`` (the agreement on the plan
and options) except the agreement on the shared-sum plan, so a rank that built a different
model gets an error instead of pairing the wrong collectives. Nothing here runs during a step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._collectives import broadcast_tensors
from gradsync_torch._specs import (
    dtype_name,
    is_expert,
    named_parameters,
    param_specs,
    shared_param_specs,
)
from gradsync_torch.agreement import Disagreement, agree_on
from gradsync_torch.data_parallel.buckets import make_plan
from gradsync_torch.data_parallel.grad_sharding import pad_for_sharding
from gradsync_torch.data_parallel.options import DataParallelOptions
from gradsync_torch.groups import ProcessGroups


class ModuleParams(NamedTuple):
    """The module's parameters, read once at construction: every later step uses this."""

    named: list[tuple[str, nn.Parameter]]  # every parameter, tied ones once, frozen ones too
    experts: frozenset[str]  # declared split over "ep" (``is_expert``): reduced over edp

    @classmethod
    def of(cls, module: nn.Module) -> ModuleParams:
        named = named_parameters(module)
        return cls(named, frozenset(name for name, p in named if is_expert(p)))

    @property
    def dense(self) -> list[tuple[str, nn.Parameter]]:
        return [(name, p) for name, p in self.named if name not in self.experts]


class GroupChoice(NamedTuple):
    """The groups DataParallel reduces over."""

    process_group: dist.ProcessGroup | None  # data-parallel; None: the world
    shared_plan: gradsync_core.ReductionPlan | None  # model-parallel sums after the mean


class Layout(NamedTuple):
    """What DataParallel plans from the module before talking to any other rank."""

    specs: list[gradsync_core.ParamSpec]  # every dense parameter, frozen ones too
    trainable: list[tuple[str, nn.Parameter]]  # position = slot
    frozen: list[nn.Parameter]
    plan: gradsync_core.BucketPlan


def resolve_groups(
    module: nn.Module,
    params: ModuleParams,
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
    takes part, so ranks of other dp groups need not call it). No collective runs here.

    Raises:
        TypeError: if ``groups`` or ``shared_plan`` has the wrong type.
        ValueError: on conflicting arguments, a model whose sums cannot be derived, or
            ``shard_gradients`` with model-parallel sums.
    """
    if groups is None:
        _check_without_groups(params, shared_plan)
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
    shared_plan = _shared_plan(module, groups, shared_plan)
    if shard_gradients and shared_plan.reductions:
        raise ValueError(
            "shard_gradients=True cannot be combined with shared-parameter sums (here over "
            f"{list(shared_plan.group_names)}): after the reduce-scatter each rank holds only "
            "its shard of a bucket, and members of a model-parallel group may hold different "
            "buckets; use shard_gradients=False with model parallelism "
            "(ZeroRedundancyOptimizer still shards the optimizer state, ZeRO-1)"
        )
    dp = groups.group("dp")
    if dp.size > 1:
        return GroupChoice(dp.process_group, shared_plan)
    alone = dist.new_group([dp.ranks[0]], use_local_synchronization=True)
    return GroupChoice(alone, shared_plan)


def _check_without_groups(
    params: ModuleParams, shared_plan: gradsync_core.ReductionPlan | None
) -> None:
    if params.experts:
        experts = sorted(params.experts)
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


def _shared_plan(
    module: nn.Module, groups: ProcessGroups, shared_plan: gradsync_core.ReductionPlan | None
) -> gradsync_core.ReductionPlan:
    if shared_plan is not None:
        if not isinstance(shared_plan, gradsync_core.ReductionPlan):
            raise TypeError(
                "shared_plan must be a gradsync_core.ReductionPlan, got "
                f"{type(shared_plan).__name__}"
            )
        return shared_plan
    try:
        specs = shared_param_specs(module)
    except ValueError as err:
        raise ValueError(
            f"DataParallel(groups=...) derives the model-parallel gradient sums from the "
            f"model, but {err}; or pass shared_plan=plan_shared_reductions("
            "shared_param_specs(model, data_axes=...), groups.topology)"
        ) from None
    return gradsync_core.plan_shared_reductions(specs, groups.topology)


def plan_layout(params: ModuleParams, options: DataParallelOptions, world_size: int) -> Layout:
    """The module's dense parameters and the initial bucket plan (padded for sharding).

    Expert parameters are left out of the dense buckets: their gradients are reduced over
    ``edp`` by the shared plan (docs/design.md §6).
    """
    named = params.dense
    specs = param_specs(named)
    plan = make_plan(specs, overlap=options.overlap, bucket_cap_mb=options.bucket_cap_mb)
    if options.shard_gradients:
        plan = pad_for_sharding(plan, world_size)
    return Layout(
        specs=specs,
        trainable=[(name, p) for name, p in named if p.requires_grad],
        frozen=[p for _, p in named if not p.requires_grad],
        plan=plan,
    )


def state_entries(
    params: ModuleParams, module: nn.Module, options: DataParallelOptions
) -> list[list[Any]]:
    """What must agree besides the bucket plan: every parameter (frozen ones too), every
    buffer, and the options that change the collectives or their arithmetic; JSON-ready."""
    entries = options.entries()
    for name, p in params.named:
        kind = "parameter" if p.requires_grad else "frozen parameter"
        entries.append([kind, name, list(p.shape), dtype_name(p.dtype)])
    for name, b in module.named_buffers():
        entries.append(["buffer", name, list(b.shape), dtype_name(b.dtype)])
    return entries


def _describe_entries(mine: Sequence[Sequence[Any]], theirs: Sequence[Sequence[Any]]) -> str:
    for a, b in zip(mine, theirs, strict=False):
        if list(a) != list(b):
            return f"{' '.join(map(str, a))} vs {' '.join(map(str, b))}"
    if len(mine) != len(theirs):
        longer = mine if len(mine) > len(theirs) else theirs
        extra = longer[min(len(mine), len(theirs))]
        return f"one side has more entries, starting with {' '.join(map(str, extra))}"
    return ""


def _describe_state(d: Disagreement) -> str:
    base, other = d.base, d.other
    detail = gradsync_core.describe_difference(
        gradsync_core.BucketPlan.from_json(base["plan"]),
        gradsync_core.BucketPlan.from_json(other["plan"]),
    )
    if base["entries"] != other["entries"]:
        # Named too when the plan differs: a differing option (bucket_cap_mb, overlap) is
        # what the user has to fix, the plan difference only how it shows.
        entries = _describe_entries(base["entries"], other["entries"])
        detail = f"{detail}; {entries}" if detail else entries
    if not detail:
        detail = "the descriptions are equal but their digests differ"
    return (
        f"DataParallel: ranks {d.agreeing} and ranks {d.differing} hold different models or "
        f"options; rank {d.base_rank} vs rank {d.other_rank}: {detail}. Build the same model "
        "(same parameters in the same order, shapes, dtypes, requires_grad) and pass the same "
        "DataParallel arguments on every rank"
    )


def verify_same_everywhere(
    plan: gradsync_core.BucketPlan,
    entries: list[list[Any]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Raise on every rank if any rank of ``group`` holds a different plan or state layout
    (``agree_on``: one digest all-gather, the descriptions only on a mismatch).

    Raises:
        ValueError: naming the ranks that disagree with group rank 0 and the first
            differing parameter, buffer or option.
    """
    payload = {"plan": plan.to_json(), "entries": entries}
    agree_on(payload, group, describe=_describe_state, device=device)


def broadcast_state(
    module: nn.Module,
    params: ModuleParams,
    group: dist.ProcessGroup,
    groups: ProcessGroups | None,
) -> None:
    """Start from rank 0's state (DDP's ``_sync_module_states``), after the agreement: the
    dense weights and the buffers over the data-parallel ``group``; expert weights from
    ``edp`` rank 0 over ``edp`` (the dense ``dp`` group spans ranks holding different
    experts, so those are copied only between the ranks that hold the same experts)."""
    if params.experts and groups is not None and groups.size("edp") > 1:
        experts = [p for name, p in params.named if name in params.experts]
        broadcast_tensors(experts, groups.group("edp").process_group)
    tensors: list[torch.Tensor] = [p for _, p in params.dense]
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
