"""Communication hooks with torch DDP's contract: ``hook(state, bucket) -> Future[Tensor]``.

A hook receives one bucket (a flat tensor holding the bucket's gradients, see ``GradBucket``)
and returns a future whose value is the reduced flat tensor; ``DataParallel`` copies that value
back into the bucket if the hook returned a different tensor. As in DDP, a hook owns the whole
reduction, division by the group size included. torch's own hooks
(``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``) accept these buckets too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
import torch.distributed as dist

CommHook: TypeAlias = Callable[[Any, "GradBucket"], torch.futures.Future[torch.Tensor]]


class GradBucket:
    """What a comm hook sees of one bucket (the methods of ``torch.distributed.GradBucket``).

    Args:
        index: the bucket's position in the plan (bucket 0 is reduced first).
        buffer: the flat gradient tensor of the bucket (reduce it in place or return another).
        gradients: one view of ``buffer`` per parameter, shaped like the parameter.
        parameters: the parameters whose gradients the bucket holds, in slot order.
        is_last: whether this is the last bucket reduced in this step.
    """

    __slots__ = ("_buffer", "_gradients", "_index", "_is_last", "_parameters")

    def __init__(
        self,
        index: int,
        buffer: torch.Tensor,
        gradients: Sequence[torch.Tensor],
        parameters: Sequence[torch.Tensor],
        is_last: bool,
    ) -> None:
        self._index = index
        self._buffer = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return list(self._gradients)

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else dist.group.WORLD


def allreduce_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average the bucket over ``process_group`` (what ``DataParallel`` does without a hook).

    Divides before the sum, as DDP does, so fp16 sums do not overflow.

    Example:
        >>> model.register_comm_hook(None, allreduce_hook)  # doctest: +SKIP
    """
    group = _group(process_group)
    buffer = bucket.buffer()
    buffer.div_(group.size())
    work = dist.all_reduce(buffer, group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _compress_hook(
    dtype: torch.dtype, process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    group = _group(process_group)
    buffer = bucket.buffer()
    wire = buffer.to(dtype).div_(group.size())

    def decompress(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        # Back into the gradient dtype, in place, so the peak memory stays one bucket.
        return buffer.copy_(fut.value()[0])

    work = dist.all_reduce(wire, group=group, async_op=True)
    return work.get_future().then(decompress)


def bf16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in bfloat16 on the wire (half the bytes), result cast back to the grad dtype.

    Same arithmetic as torch DDP's ``bf16_compress_hook`` and as ``DataParallel(...,
    reduce_dtype=torch.bfloat16)``: cast, divide by the group size, sum in bfloat16.

    Example:
        >>> model.register_comm_hook(None, bf16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.bfloat16, process_group, bucket)


def fp16_compress_hook(
    process_group: dist.ProcessGroup | None, bucket: GradBucket
) -> torch.futures.Future[torch.Tensor]:
    """Average in float16 on the wire, result cast back to the grad dtype (DDP's hook).

    Example:
        >>> model.register_comm_hook(None, fp16_compress_hook)  # doctest: +SKIP
    """
    return _compress_hook(torch.float16, process_group, bucket)
