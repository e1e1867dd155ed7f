"""The runtime of a bucket plan: one flat buffer per bucket, reused every step.

``make_plan`` picks the initial layout (DDP's capped assignment, or fairseq's legacy one);
``build_buckets`` allocates it; ``GradSlots`` holds the per-parameter flags of a backward.
The ``Reducer`` (``reducer.py``) owns the resulting ``BucketBuffers`` and ``GradSlots`` and
everything that changes in them during a step; its ``BucketCollective``
(``bucket_collectives.py``) reads and writes them through the verbs it is given.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import gradsync_core

# On the CPU, a bucket whose tensors average at least this many elements is divided tensor by
# tensor while copying (one pass over memory, as DDP does); smaller tensors are copied in one
# ``torch._foreach_copy_`` and the bucket is divided once, where the per-tensor call would cost
# more than the second pass. On an accelerator the host launching kernels is the critical path,
# so buckets are always gathered in a batch there.
PER_TENSOR_DIVISION_MIN_NUMEL = 1 << 16


def make_plan(
    specs: list[gradsync_core.ParamSpec], *, overlap: bool, bucket_cap_mb: float | None
) -> gradsync_core.BucketPlan:
    """The initial layout: DDP's capped assignment (overlap) or fairseq's (legacy).

    DDP's cap convention: no cap given -> 25 MiB buckets with a 1 MiB first bucket; a cap
    given -> that cap for every bucket. Legacy mode reads the cap as the size of its reused
    buffer (default 2**28 elements).
    """
    if overlap:
        cap, first = gradsync_core.bucket_caps(bucket_cap_mb)
        return gradsync_core.plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first)
    max_numel = gradsync_core.legacy_max_numel(specs, bucket_cap_mb)
    return gradsync_core.plan_legacy_buckets(specs, max_numel=max_numel)


@dataclass(eq=False)
class BucketBuffers:
    """The runtime of one plan bucket: its flat buffer and one view per parameter."""

    spec: gradsync_core.Bucket
    buffer: torch.Tensor  # flat, spec.numel elements of the gradients' dtype
    views: tuple[torch.Tensor, ...]  # views[i] is slot i of the bucket, shaped like its param
    params: tuple[nn.Parameter, ...]
    slot_ids: tuple[int, ...]  # the Reducer's slots (positions among trainable parameters)
    wire: torch.Tensor | None  # the same elements in reduce_dtype, if it differs
    pending: int = 0  # gradients still to arrive in this backward
    staged: bool = False  # its gradients are gathered into the buffer in this backward
    handle: Any = field(default=None, repr=False)  # Work or Future of the collective in flight

    def reset(self) -> None:
        self.pending = len(self.params)
        self.staged = False
        self.handle = None


class GradSlots:
    """Per trainable parameter (by slot): ``fired``, its gradient arrived in this synced
    backward; ``preset``, its ``.grad`` is a zeroed bucket view the Reducer bound, not a
    gradient yet (``gradient_as_bucket_view``)."""

    def __init__(self, n: int) -> None:
        self.fired = [False] * n
        self.preset = [False] * n

    def has_grad(self, slot: int, param: torch.Tensor) -> bool:
        """Whether this rank holds a gradient of ``param`` to contribute."""
        return self.fired[slot] or (param.grad is not None and not self.preset[slot])


def build_buckets(
    plan: gradsync_core.BucketPlan,
    params: dict[str, nn.Parameter],
    slot_of: dict[str, int],
    *,
    reduce_dtype: torch.dtype | None,
    shared: bool,
) -> list[BucketBuffers]:
    """Allocate the buffers of ``plan`` once; they are reused every step.

    Args:
        plan: the bucket layout.
        params: trainable parameters by name.
        slot_of: each trainable parameter's position in the wrapper's list.
        reduce_dtype: the dtype on the wire, ``None`` for the gradients' own.
        shared: one staging buffer per (dtype, device), as large as the largest bucket, reused
            by every bucket (fairseq's legacy mode: buckets must then be reduced one by one).
    """
    staging: dict[tuple[torch.dtype, torch.device], tuple[torch.Tensor, torch.Tensor | None]] = {}
    if shared:
        sizes: dict[tuple[torch.dtype, torch.device], int] = {}
        for bucket in plan.buckets:
            first = params[bucket.slots[0].name]
            key = (first.dtype, first.device)
            sizes[key] = max(sizes.get(key, 0), bucket.numel)
        for (dtype, device), numel in sizes.items():
            wire = None
            if reduce_dtype is not None and reduce_dtype != dtype:
                wire = torch.zeros(numel, dtype=reduce_dtype, device=device)
            staging[(dtype, device)] = (torch.zeros(numel, dtype=dtype, device=device), wire)
    out = []
    for bucket in plan.buckets:
        members = tuple(params[slot.name] for slot in bucket.slots)
        dtype, device = members[0].dtype, members[0].device
        if shared:
            full, full_wire = staging[(dtype, device)]
            buffer = full[: bucket.numel]
            wire = None if full_wire is None else full_wire[: bucket.numel]
        else:
            buffer = torch.zeros(bucket.numel, dtype=dtype, device=device)
            wire = None
            if reduce_dtype is not None and reduce_dtype != dtype:
                wire = torch.zeros(bucket.numel, dtype=reduce_dtype, device=device)
        views = tuple(
            buffer[slot.offset : slot.offset + slot.numel].view(slot.shape) for slot in bucket.slots
        )
        state = BucketBuffers(
            spec=bucket,
            buffer=buffer,
            views=views,
            params=members,
            slot_ids=tuple(slot_of[slot.name] for slot in bucket.slots),
            wire=wire,
        )
        state.reset()
        out.append(state)
    return out
