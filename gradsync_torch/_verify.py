"""Construction-time agreement across ranks: same plan (docs/design.md §8), same starting state.

A rank that builds a different model would otherwise hang in the first mismatched
collective, or silently train garbage when sizes happen to line up. One all-gather of a
32-byte digest makes the check cost nothing when everything agrees; only on a mismatch are the
full descriptions gathered to name the ranks and the first difference.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._specs import dtype_name
from gradsync_torch.model_parallel.groups import ProcessGroups
from gradsync_torch.model_parallel.layers import shared_param_specs

_MIB = 1024 * 1024
# DDP broadcasts module states in chunks of this size (torch.distributed.utils).
_BROADCAST_CHUNK_BYTES = 250 * _MIB
# torch 2.13 renamed all_gather_into_tensor (and warns on the old name); older torch lacks it.
from gradsync_torch._collectives import all_gather_single as _all_gather_single


def check_arguments(
    module: object,
    *,
    reduce: str,
    reduce_dtype: object,
    bucket_cap_mb: float | None,
    overlap: bool,
    gradient_as_bucket_view: bool,
    param_broadcast_period: object,
) -> None:
    """DataParallel's argument checks: one sentence per mistake, before any collective."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    if reduce_dtype is not None and not (
        isinstance(reduce_dtype, torch.dtype) and reduce_dtype.is_floating_point
    ):
        raise ValueError(
            f"reduce_dtype must be a floating torch.dtype such as torch.bfloat16, "
            f"got {reduce_dtype!r}"
        )
    if bucket_cap_mb is not None and not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive or None, got {bucket_cap_mb!r}")
    if not isinstance(param_broadcast_period, int) or param_broadcast_period < 0:
        raise ValueError(
            f"param_broadcast_period must be an int >= 0 (0: never), got {param_broadcast_period!r}"
        )
    if gradient_as_bucket_view and not overlap:
        raise ValueError(
            "gradient_as_bucket_view=True needs overlap=True: legacy mode reuses one "
            "buffer for every bucket, so gradients cannot live in it"
        )


def check_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The data-parallel group (default: the world), or a clear error if it cannot serve."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "DataParallel needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets "
            "the environment for it)"
        )
    group = dist.group.WORLD if process_group is None else process_group
    if group is None or group == dist.GroupMember.NON_GROUP_MEMBER or dist.get_rank(group) < 0:
        raise ValueError(
            f"rank {dist.get_rank()} is not a member of the process_group passed to "
            "DataParallel; every rank that wraps the model must belong to its data-parallel "
            "group (build it with torch.distributed.new_group on all ranks and pass each "
            "rank its own group)"
        )
    return group


def resolve_shared(
    module: nn.Module,
    *,
    process_group: dist.ProcessGroup | None,
    groups: ProcessGroups | None,
    shared_plan: gradsync_core.ReductionPlan | None,
    shard_gradients: bool,
) -> tuple[dist.ProcessGroup | None, gradsync_core.ReductionPlan | None]:
    """DataParallel's model-parallel arguments: ``(data-parallel group, shared-sum plan)``.

    With ``groups`` the data-parallel group is ``groups["dp"]`` and, unless ``shared_plan``
    is given, the plan is derived from the layers' sharding declarations (docs/design.md §6). A dp
    axis of size 1 has no process group in ``ProcessGroups``; DataParallel still needs one
    (its checks and buffers), so it gets this rank alone, created locally (no other rank
    takes part, so ranks of other dp groups need not call it).
    """
    if groups is None:
        if shared_plan is not None:
            raise ValueError(
                "shared_plan needs groups=: pass the ProcessGroups the plan's reduction "
                "groups live in (DataParallel(model, groups=groups, shared_plan=plan))"
            )
        return process_group, None
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
    dp = groups.group("dp")
    if dp.size > 1:
        return dp.process_group, shared_plan
    return dist.new_group([dp.ranks[0]], use_local_synchronization=True), shared_plan


def comm_device(params: Sequence[torch.Tensor], group: dist.ProcessGroup) -> torch.device:
    """Where the small bookkeeping collectives run: the parameters' device."""
    devices = {p.device for p in params} or {torch.device("cpu")}
    if len({d.type for d in devices}) > 1:
        raise ValueError(
            f"DataParallel needs all trainable parameters on one device type, found "
            f"{sorted(str(d) for d in devices)}; move the model with module.to(device)"
        )
    device = next(iter(devices))
    if "nccl" in str(dist.get_backend(group)) and device.type != "cuda":
        raise ValueError(
            "the process group uses NCCL, which needs CUDA tensors, but the model is on "
            f"{device}; move it with module.to('cuda', local_rank) or use gloo on CPU"
        )
    return device


def check_grad(name: str, grad: torch.Tensor) -> None:
    """A gradient DataParallel can reduce: dense and not part of a graph (docs/design.md §7)."""
    if grad.layout != torch.strided:
        raise RuntimeError(
            f"parameter {name!r} has a {grad.layout} gradient; DataParallel reduces dense "
            "gradients only (use nn.Embedding(sparse=False))"
        )
    if grad.requires_grad:
        raise RuntimeError(
            f"the gradient of {name!r} requires grad (backward(create_graph=True)); "
            "DataParallel cannot sync a gradient that is part of a graph: compute "
            "higher-order terms with torch.autograd.grad"
        )


def state_entries(module: nn.Module, options: dict[str, Any]) -> list[list[Any]]:
    """What must agree besides the bucket plan: every parameter (frozen ones too), every
    buffer, and the options that change the arithmetic; JSON-ready."""
    entries: list[list[Any]] = [["option", key, repr(value)] for key, value in options.items()]
    for name, p in module.named_parameters():
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
    return "the descriptions are equal but their digests differ"


def verify_same_everywhere(
    plan: gradsync_core.BucketPlan,
    entries: list[list[Any]],
    group: dist.ProcessGroup,
    device: torch.device,
) -> None:
    """Raise on every rank if any rank of ``group`` holds a different plan or state layout.

    Raises:
        ValueError: naming the ranks that disagree with group rank 0 and the first
            differing parameter, buffer or option.
    """
    payload = {"plan": plan.to_json(), "entries": entries}
    digest = hashlib.sha256(gradsync_core.canonical_json(payload).encode("ascii")).digest()
    mine = torch.tensor(list(digest), dtype=torch.uint8, device=device)
    world_size = group.size()
    gathered = torch.empty(world_size * len(digest), dtype=torch.uint8, device=device)
    _all_gather_single(gathered, mine, group=group)
    rows = [bytes(row) for row in gathered.view(world_size, -1).cpu().tolist()]
    if all(row == rows[0] for row in rows):
        return
    described: list[Any] = [None] * world_size
    dist.all_gather_object(described, payload, group=group)
    global_ranks = [dist.get_global_rank(group, r) for r in range(world_size)]
    agree = [global_ranks[r] for r in range(world_size) if rows[r] == rows[0]]
    differ = [global_ranks[r] for r in range(world_size) if rows[r] != rows[0]]
    first = next(r for r in range(world_size) if rows[r] != rows[0])
    base, other = described[0], described[first]
    detail = gradsync_core.describe_difference(
        gradsync_core.BucketPlan.from_json(base["plan"]),
        gradsync_core.BucketPlan.from_json(other["plan"]),
    )
    if not detail:
        detail = _describe_entries(base["entries"], other["entries"])
    raise ValueError(
        f"DataParallel: ranks {agree} and ranks {differ} hold different models or options; "
        f"rank {global_ranks[0]} vs rank {global_ranks[first]}: {detail}. Build the same "
        "model (same parameters in the same order, shapes, dtypes, requires_grad) and pass "
        "the same DataParallel arguments on every rank"
    )


def broadcast_tensors(
    tensors: Iterable[torch.Tensor], group: dist.ProcessGroup, *, group_src: int = 0
) -> None:
    """Overwrite ``tensors`` in place with group rank ``group_src``'s values.

    Tensors are packed per (dtype, device) into flat chunks of at most 250 MiB (DDP's
    ``_sync_module_states`` does the same), so a model costs a few collectives, not one per
    tensor.
    """
    by_key: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        by_key.setdefault((t.dtype, t.device), []).append(t)
    for members in by_key.values():
        chunk: list[torch.Tensor] = []
        nbytes = 0
        for t in [*members, None]:
            if t is not None and (not chunk or nbytes + t.nbytes <= _BROADCAST_CHUNK_BYTES):
                chunk.append(t)
                nbytes += t.nbytes
                continue
            flat = torch.cat([c.detach().reshape(-1) for c in chunk])
            dist.broadcast(flat, src=dist.get_global_rank(group, group_src), group=group)
            offset = 0
            with torch.no_grad():
                for c in chunk:
                    c.copy_(flat[offset : offset + c.numel()].view_as(c))
                    offset += c.numel()
            if t is not None:
                chunk, nbytes = [t], t.nbytes
