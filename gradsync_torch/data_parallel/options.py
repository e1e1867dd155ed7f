"""``DataParallel``'s options every rank must agree on, checked before any collective.

See docs/design.md §8.

Every check here is local, so a mistake on one rank cannot leave the others waiting; what
must also be *equal* across ranks is the frozen ``DataParallelOptions`` record, compared by
``setup.verify_same_everywhere`` together with the bucket plan.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclasses.dataclass(frozen=True)
class DataParallelOptions:
    """The ``DataParallel`` options that change the sequence of collectives or their
    arithmetic, so every rank must pass the same ones (a buffer broadcast on one rank would
    meet a bucket all-reduce on another and hang). ``tests/faults`` walks the fields.

    See ``DataParallel`` for each option's meaning; it takes them as its keywords or as this
    record (``DataParallel(module, options=DataParallelOptions(...))``), never both.

    Raises:
        ValueError: on a value or combination that cannot work, naming the fix.

    Example:
        >>> options = DataParallelOptions(bucket_cap_mb=50, check_finite=True)
        >>> model = DataParallel(net, options=options)  # doctest: +SKIP
    """

    bucket_cap_mb: float | None = None
    overlap: bool = True
    reduce: str = "mean"
    reduce_dtype: torch.dtype | None = None
    gradient_as_bucket_view: bool = False
    broadcast_buffers: bool = True
    param_broadcast_period: int = 0
    shard_gradients: bool = False
    check_finite: bool = False

    def __post_init__(self) -> None:
        if self.reduce not in ("mean", "sum"):
            raise ValueError(f"reduce must be 'mean' or 'sum', got {self.reduce!r}")
        dtype = self.reduce_dtype
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ValueError(
                f"reduce_dtype must be a floating torch.dtype such as torch.bfloat16, got {dtype!r}"
            )
        if self.bucket_cap_mb is not None and not self.bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive or None, got {self.bucket_cap_mb!r}")
        period = self.param_broadcast_period
        if not isinstance(period, int) or period < 0:
            raise ValueError(
                f"param_broadcast_period must be an int >= 0 (0: never), got {period!r}"
            )
        self._check_combinations()

    def _check_combinations(self) -> None:
        if self.gradient_as_bucket_view and not self.overlap:
            raise ValueError(
                "gradient_as_bucket_view=True needs overlap=True: legacy mode reuses one "
                "buffer for every bucket, so gradients cannot live in it"
            )
        if self.shard_gradients and self.gradient_as_bucket_view:
            raise ValueError(
                "shard_gradients=True drops param.grad after each bucket's reduce-scatter, so "
                "gradients cannot be bucket views; leave gradient_as_bucket_view=False"
            )
        if self.check_finite and self.shard_gradients:
            raise ValueError(
                "check_finite=True reads the all-reduced buckets, which shard_gradients=True "
                "replaces by a reduce-scatter (each rank sees only its shard); use one or the "
                "other"
            )
        if self.shard_gradients and self.reduce_dtype is not None:
            raise ValueError(
                f"shard_gradients=True reduce-scatters in the gradients' dtype; reduce_dtype="
                f"{self.reduce_dtype} is not supported with it (leave reduce_dtype=None)"
            )

    def entries(self) -> list[list[Any]]:
        """``["option", name, repr(value)]`` per field, in field order (JSON-ready)."""
        return [
            ["option", field.name, repr(getattr(self, field.name))]
            for field in dataclasses.fields(self)
        ]


def check_module(module: object) -> None:
    """Raise ``TypeError`` unless ``module`` is an ``nn.Module``."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"DataParallel wraps an nn.Module, got {type(module).__name__}")


def check_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """The data-parallel group (default: the world), or a clear error if it cannot serve."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "DataParallel needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first (torchrun sets "
            "the environment for it)"
        )
    group = dist.group.WORLD if process_group is None else process_group
    non_member = dist.GroupMember.NON_GROUP_MEMBER  # what new_group returns to non-members
    if group is None or group == non_member or dist.get_rank(group) < 0:  # type: ignore[comparison-overlap]
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
