"""Cross-rank checks: arguments, groups, gradients, and agreement on the plan (docs/design.md §8).

A rank that builds a different model would otherwise hang in the first mismatched
collective, or silently train garbage when sizes happen to line up. One all-gather of a
32-byte digest makes the check cost nothing when everything agrees; only on a mismatch are the
full descriptions gathered to name the ranks and the first difference. The argument checks run
before any collective, so a mistake on one rank cannot leave the others waiting.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._collectives import all_gather_single
from gradsync_torch._specs import dtype_name


def check_arguments(
    module: object,
    *,
    reduce: str,
    reduce_dtype: object,
    bucket_cap_mb: float | None,
    overlap: bool,
    gradient_as_bucket_view: bool,
    param_broadcast_period: object,
    shard_gradients: bool,
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
    if shard_gradients and gradient_as_bucket_view:
        raise ValueError(
            "shard_gradients=True drops param.grad after each bucket's reduce-scatter, so "
            "gradients cannot be bucket views; leave gradient_as_bucket_view=False"
        )
    if shard_gradients and reduce_dtype is not None:
        raise ValueError(
            f"shard_gradients=True reduce-scatters in the gradients' dtype; reduce_dtype="
            f"{reduce_dtype} is not supported with it (leave reduce_dtype=None)"
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
    """A gradient DataParallel can reduce: dense and not part of a graph (docs/design.md §7).

    Raises:
        RuntimeError: for a sparse gradient or one that requires grad (the model-parallel
            reductions raise the same type for the same mistakes).
    """
    if grad.layout != torch.strided:
        raise RuntimeError(
            f"parameter {name!r} has a {grad.layout} gradient of shape {tuple(grad.shape)}; "
            "DataParallel reduces dense gradients only (use nn.Embedding(sparse=False))"
        )
    if grad.requires_grad:
        raise RuntimeError(
            f"the gradient of {name!r} requires grad (backward(create_graph=True)); "
            "DataParallel cannot sync a gradient that is part of a graph: compute "
            "higher-order terms with torch.autograd.grad"
        )


def state_entries(module: nn.Module, options: dict[str, Any]) -> list[list[Any]]:
    """What must agree besides the bucket plan: every parameter (frozen ones too), every
    buffer, and the options that change the collectives or their arithmetic; JSON-ready."""
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
    return ""


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
    all_gather_single(gathered, mine, group=group)
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
    if base["entries"] != other["entries"]:
        # Named too when the plan differs: a differing option (bucket_cap_mb, overlap) is
        # what the user has to fix, the plan difference only how it shows.
        entries = _describe_entries(base["entries"], other["entries"])
        detail = f"{detail}; {entries}" if detail else entries
    if not detail:
        detail = "the descriptions are equal but their digests differ"
    raise ValueError(
        f"DataParallel: ranks {agree} and ranks {differ} hold different models or options; "
        f"rank {global_ranks[0]} vs rank {global_ranks[first]}: {detail}. Build the same "
        "model (same parameters in the same order, shapes, dtypes, requires_grad) and pass "
        "the same DataParallel arguments on every rank"
    )
