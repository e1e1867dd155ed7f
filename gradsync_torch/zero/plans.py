"""Which rank owns what: the ZeRO-1 and ZeRO-2 shard plans of an optimizer's parameters.

Pure functions of gradsync_core specs and plans (docs/design.md §4, §9), apart from
``check_same_plan`` and ``check_same_settings``, which agree on the plan and on the optimizer
(class and every hyper-parameter of every param group) across ranks (``agreement.agree_on``)
before any collective uses them: each owner steps its shard with its own settings, so ranks
that differ would otherwise diverge silently.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from gradsync_core import (
    BucketPlan,
    ParamSpec,
    ShardPlan,
    plan_buckets,
    plan_flat_shards,
    plan_greedy_shards,
)
from gradsync_torch._optim_state import hyper_parameters, optimizer_name
from gradsync_torch.agreement import Disagreement, agree_on


def plan_shards(
    specs: Sequence[ParamSpec],
    groups: Sequence[int],
    *,
    group_count: int,
    segment_starts: Sequence[int],
    world_size: int,
    flat: bool,
    cap_bytes: int,
) -> ShardPlan:
    """The plan of an optimizer on its own: torch's greedy partition per param group
    (ZeRO-1), or flat shards of padded buckets (ZeRO-2), one bucket run per segment of param
    groups (the constructor's groups, then each added group; ``segment_starts`` are their
    first group indices)."""
    per_group: list[list[ParamSpec]] = [[] for _ in range(group_count)]
    for spec, g in zip(specs, groups, strict=True):
        per_group[g].append(spec)
    if not flat:
        return plan_greedy_shards(per_group, world_size=world_size)
    bounds = [*segment_starts, group_count]
    segments = [
        [s for g in range(a, b) for s in per_group[g]] for a, b in itertools.pairwise(bounds)
    ]
    group_of_name = {s.name: g for s, g in zip(specs, groups, strict=True)}
    return plan_flat(segments, group_of_name, world_size=world_size, cap_bytes=cap_bytes)


def concat_bucket_plans(plans: Sequence[BucketPlan]) -> BucketPlan:
    """One plan holding the buckets of ``plans`` in order (re-indexed): parameters added
    with ``add_param_group`` get buckets of their own and leave the earlier ones alone."""
    return BucketPlan.concat(plans)


def plan_flat(
    segments: Sequence[Sequence[ParamSpec]],
    groups: dict[str, int],
    *,
    world_size: int,
    cap_bytes: int,
) -> ShardPlan:
    """The ZeRO-2 plan: each segment (the constructor's groups, then each added group)
    bucketed with ``pad_to=world_size`` and cut by ``plan_flat_shards``."""
    plans = [
        plan_buckets(seg, cap_bytes=cap_bytes, pad_to=world_size)
        for seg in segments
        if any(s.requires_grad for s in seg)
    ]
    if not plans:
        return ShardPlan(kind="flat", world_size=world_size, shards=())
    plan = plan_flat_shards(concat_bucket_plans(plans), world_size=world_size)
    shards = tuple(dataclasses.replace(s, group=groups[s.name]) for s in plan.shards)
    return dataclasses.replace(plan, shards=shards)


def rename_plan(plan: ShardPlan, names: dict[str, str], groups: dict[str, int]) -> ShardPlan:
    """``plan`` with parameters renamed by ``names`` and shard groups set by ``groups``
    (parameters missing from them keep theirs): DataParallel's names are the module's,
    a checkpoint's are the optimizer's. One rule for both executors: ``ShardPlan.renamed``."""
    return plan.renamed(names, groups)


def plan_over_buckets(
    bucket_plan: BucketPlan,
    module_params: dict[str, torch.Tensor],
    params: Sequence[torch.Tensor],
    specs: Sequence[ParamSpec],
    groups: Sequence[int],
    *,
    world_size: int,
) -> ShardPlan:
    """The flat plan of a sharding ``DataParallel``'s (padded) ``bucket_plan``, whose slots
    carry the module's names (``module_params``), renamed and grouped as the optimizer
    holding ``params`` (with ``specs`` and param-group indices ``groups``) names them."""
    index = {id(p): i for i, p in enumerate(params)}
    ours = {name: index[id(p)] for name, p in module_params.items() if id(p) in index}
    base = plan_flat_shards(bucket_plan, world_size=world_size)
    names = {name: specs[i].name for name, i in ours.items()}
    return rename_plan(base, names, {name: groups[i] for name, i in ours.items()})


def optimizer_settings(
    optimizer_class: type, param_groups: Sequence[dict[str, Any]]
) -> dict[str, Any]:
    """What every rank's optimizer must agree on: its class and the hyper-parameters of every
    param group, as JSON (numbers, bools, strings and tuples of them as they are; 1-element
    tensors as their number; anything else by ``repr``, without memory addresses)."""
    return {
        "optimizer": optimizer_name(optimizer_class),
        "groups": [
            {k: _jsonable(v) for k, v in sorted(hyper_parameters(g).items())} for g in param_groups
        ],
    }


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()  # a tensor lr (capturable optimizers): its value is what matters
    text = repr(value)
    # An object without a value repr (a function, say) prints its address, unequal per rank.
    return f"<{type(value).__qualname__}>" if " at 0x" in text else text


def check_same_plan(
    plan: ShardPlan,
    specs: Sequence[ParamSpec],
    group: Any,
    world_size: int,
    settings: dict[str, Any] | None = None,
) -> None:
    """Every rank must hold the same plan, or the sync collectives mismatch and hang
    (docs/design.md §8), and the same optimizer ``settings`` (``optimizer_settings``), or each
    owner steps its shard differently: ``agree_on`` the plan's fingerprint and the settings
    (one digest all-gather), and the parameter tables only on a mismatch, to name the first
    difference.

    Raises:
        ValueError: naming a differing rank and the first differing parameter, or the
            differing optimizer class, or the param group, key and values that differ.
    """
    if world_size == 1:
        return
    table = [(s.name, s.shape, s.dtype, s.requires_grad) for s in specs]
    agree_on(
        [plan.fingerprint, settings],
        group,
        describe=_describe_plans,
        detail={"table": table, "settings": settings},
    )


def check_same_settings(settings: dict[str, Any], group: Any, world_size: int) -> None:
    """``check_same_plan`` for the optimizer settings alone (after ``load`` or
    ``load_state_dict`` set new hyper-parameters; the plan did not change).

    Raises:
        ValueError: naming the ranks, the param group, the key and both values.
    """
    if world_size == 1:
        return
    agree_on(settings, group, describe=_describe_settings)


def _describe_settings(d: Disagreement) -> str:
    return (
        f"ranks {d.base_rank} and {d.other_rank} built ZeroRedundancyOptimizer with different "
        f"settings ({settings_difference(d.base, d.other)}); every owner steps its shard with "
        "its own, so pass the same optimizer class and hyper-parameters on every rank"
    )


def settings_difference(mine: dict[str, Any], theirs: dict[str, Any]) -> str:
    """The first difference between two ``optimizer_settings``, as a phrase."""
    if mine["optimizer"] != theirs["optimizer"]:
        return f"optimizer {mine['optimizer']} vs {theirs['optimizer']}"
    a, b = mine["groups"], theirs["groups"]
    if len(a) != len(b):
        return f"{len(a)} vs {len(b)} param groups"
    for g, (x, y) in enumerate(zip(a, b, strict=True)):
        for key in sorted(set(x) | set(y)):
            ours, other = x.get(key, "(absent)"), y.get(key, "(absent)")
            if ours != other:
                return f"param group {g}: {key} {ours} vs {other}"
    return "equal settings"  # unreachable: the digests differed


def _describe_plans(d: Disagreement) -> str:
    mine, theirs = d.base["table"], d.other["table"]
    if mine == theirs and d.base["settings"] != d.other["settings"]:
        return _describe_settings(d._replace(base=d.base["settings"], other=d.other["settings"]))
    diff = next(
        (
            f"parameter #{i}: {a} vs {b}"
            for i, (a, b) in enumerate(zip(mine, theirs, strict=False))
            if a != b
        ),
        f"{len(mine)} vs {len(theirs)} parameters",
    )
    return (
        f"ranks {d.base_rank} and {d.other_rank} built different ZeRO plans ({diff}); every "
        "rank must pass the same parameters, in the same order, with the same requires_grad"
    )
