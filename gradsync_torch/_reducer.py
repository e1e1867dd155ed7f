"""Bucket buffers and the per-bucket collective: the one place gradients meet the group.

``DataParallel`` decides *when* a bucket is reduced (during backward, or after it); this module
decides *how*. ``Reducer.launch`` starts one bucket's collective and ``Reducer.finish`` waits
for it and leaves the reduced values in the bucket's flat buffer.

Seam for gradient sharding (ZeRO-2, arXiv:1910.02054 §5.2): a sharding reducer keeps these
two methods and swaps the collective: ``launch`` becomes a ``reduce_scatter_tensor`` of the
bucket (planned with ``gradsync_core.plan_flat_shards``, buckets padded with ``pad_to``) into
the rank's chunk, and ``finish`` waits and exposes only that chunk. Nothing else in
``DataParallel`` talks to the process group about gradients. Shared-parameter reductions
(docs/design.md §6: an extra sum over the model-parallel groups in ``ParamSpec.replicated_over``)
belong here too, as a second collective per affected bucket.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import gradsync_core
from gradsync_torch._comm_hooks import CommHook, GradBucket

_MIB = 1024 * 1024


def make_plan(
    specs: list[gradsync_core.ParamSpec], *, overlap: bool, bucket_cap_mb: float | None
) -> gradsync_core.BucketPlan:
    """The initial layout: DDP's capped assignment (overlap) or fairseq's (legacy).

    DDP's cap convention: no cap given -> 25 MiB buckets with a 1 MiB first bucket; a cap
    given -> that cap for every bucket. Legacy mode reads the cap as the size of its reused
    buffer (default 2**28 elements).
    """
    if overlap:
        if bucket_cap_mb is None:
            return gradsync_core.plan_buckets(
                specs,
                cap_bytes=gradsync_core.DEFAULT_CAP_BYTES,
                first_cap_bytes=gradsync_core.DEFAULT_FIRST_CAP_BYTES,
            )
        return gradsync_core.plan_buckets(specs, cap_bytes=max(1, int(bucket_cap_mb * _MIB)))
    max_numel = gradsync_core.DEFAULT_LEGACY_MAX_NUMEL
    if bucket_cap_mb is not None:
        trainable = [s for s in specs if s.requires_grad]
        widest = max((gradsync_core.itemsize(s.dtype) for s in trainable), default=4)
        max_numel = max(1, int(bucket_cap_mb * _MIB) // widest)
    return gradsync_core.plan_legacy_buckets(specs, max_numel=max_numel)


@dataclass(eq=False)
class BucketBuffers:
    """The runtime of one plan bucket: its flat buffer and one view per parameter."""

    spec: gradsync_core.Bucket
    buffer: torch.Tensor  # flat, spec.numel elements of the gradients' dtype
    views: tuple[torch.Tensor, ...]  # views[i] is slot i of the bucket, shaped like its param
    params: tuple[nn.Parameter, ...]
    slot_ids: tuple[int, ...]  # positions in DataParallel's list of trainable parameters
    wire: torch.Tensor | None  # the same elements in reduce_dtype, if it differs
    pending: int = 0  # gradients still to arrive in this backward
    handle: Any = field(default=None, repr=False)  # Work or Future of the collective in flight

    def reset(self) -> None:
        self.pending = len(self.params)
        self.handle = None


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


class Reducer:
    """Starts and finishes one bucket's reduction over the data-parallel group.

    Without a comm hook: divide by the group size first (``reduce="mean"``, in the reduce
    dtype, as DDP and fairseq do, so low-precision sums do not overflow; fused into the copy
    into the bucket when the wire dtype is the gradients'), then an asynchronous
    ``all_reduce``; with ``reduce_dtype`` the bucket travels in a persistent wire buffer of
    that dtype and is cast back. With a comm hook, the hook owns the reduction (DDP's
    contract) and its future's value is copied back into the bucket.
    """

    def __init__(
        self, group: dist.ProcessGroup, *, reduce: str, reduce_dtype: torch.dtype | None
    ) -> None:
        self.group = group
        self.world_size = group.size()
        self.mean = reduce == "mean"
        self.reduce_dtype = reduce_dtype
        self.hook: CommHook | None = None
        self.hook_state: Any = None

    @property
    def divides_on_copy(self) -> bool:
        # Without a hook or a wire dtype the mean's division rides on the copy into the
        # bucket (DDP does the same), saving one pass over every gradient.
        return self.mean and self.hook is None and self.reduce_dtype is None

    def copy_in(self, view: torch.Tensor, grad: torch.Tensor) -> None:
        """Put one gradient into its bucket slot (divided already, where that is due)."""
        if self.divides_on_copy:
            torch.div(grad, self.world_size, out=view)
        else:
            view.copy_(grad)

    def scale_in_place(self, view: torch.Tensor) -> None:
        """The same for a gradient that already lives in its slot (gradient_as_bucket_view)."""
        if self.divides_on_copy:
            view.div_(self.world_size)

    def launch(self, bucket: BucketBuffers, *, is_last: bool) -> None:
        """Start reducing ``bucket.buffer``; returns before the collective completes."""
        if self.hook is not None:
            view = GradBucket(
                bucket.spec.index, bucket.buffer, bucket.views, bucket.params, is_last
            )
            bucket.handle = self.hook(self.hook_state, view)
            return
        tensor = bucket.buffer
        if bucket.wire is not None:
            # Cast, then divide in the wire dtype: the arithmetic of DDP's compress hooks.
            tensor = bucket.wire.copy_(bucket.buffer)
            if self.mean:
                tensor.div_(self.world_size)
        bucket.handle = dist.all_reduce(tensor, group=self.group, async_op=True)

    def finish(self, bucket: BucketBuffers) -> None:
        """Wait for ``bucket``'s collective; the reduced values are then in ``bucket.buffer``."""
        handle, bucket.handle = bucket.handle, None
        if self.hook is not None:
            value = handle.wait()
            if isinstance(value, list | tuple):
                value = value[0]
            if not isinstance(value, torch.Tensor) or value.shape != bucket.buffer.shape:
                raise RuntimeError(
                    f"the comm hook's future for bucket {bucket.spec.index} returned "
                    f"{type(value).__name__} {getattr(value, 'shape', '')}; it must return "
                    f"a tensor of shape {tuple(bucket.buffer.shape)} (the reduced bucket)"
                )
            if value.data_ptr() != bucket.buffer.data_ptr():
                bucket.buffer.copy_(value)
            return
        handle.wait()
        if bucket.wire is not None:
            bucket.buffer.copy_(bucket.wire)
