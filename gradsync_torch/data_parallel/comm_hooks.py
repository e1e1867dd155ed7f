"""Communication hooks with torch DDP's contract: ``hook(state, bucket) -> Future[Tensor]``.

A hook receives one bucket (a flat tensor holding the bucket's gradients, see ``GradBucket``)
and returns a future whose value is the reduced flat tensor; ``DataParallel`` copies that value
back into the bucket (cast to the gradients' dtype) if the hook returned a different tensor.
As in DDP, a hook owns the whole reduction, division by the group size included. torch's own
hooks (``torch.distributed.algorithms.ddp_comm_hooks``: the default, quantization and PowerSGD
hooks) accept these buckets too, and so do its wrappers (``fp16_compress_wrapper``,
``bf16_compress_wrapper``), which swap the bucket's buffer for a cast copy before the inner hook
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias, cast

import torch
import torch.distributed as dist

CommHook: TypeAlias = Callable[[Any, "GradBucket"], torch.futures.Future[torch.Tensor]]


class GradBucket:
    """What a comm hook sees of one bucket (the methods of ``torch.distributed.GradBucket``).

    DDP's contract, which wrappers such as torch's ``fp16_compress_wrapper`` rely on:
    ``set_buffer`` replaces the flat tensor, and from then on ``buffer()`` returns the new
    tensor and ``gradients()`` returns views *of the new tensor* at the same offsets and shapes
    (DDP's C++ ``GradBucket`` slices its current buffer on every call). A wrapper can thus cast
    the bucket to a wire dtype and hand it to an inner hook that reads ``gradients()``.

    Args:
        index: the bucket's position in the plan (bucket 0 is reduced first).
        buffer: the flat gradient tensor of the bucket (reduce it in place or return another).
        gradients: one view of ``buffer`` per parameter, shaped like the parameter.
        parameters: the parameters whose gradients the bucket holds, in slot order.
        is_last: whether this is the last bucket reduced in this step.

    Example:
        >>> bucket = GradBucket(0, flat, views, params, True)  # doctest: +SKIP
        >>> bucket.set_buffer(bucket.buffer().half())
        >>> bucket.gradients()[0].dtype
        torch.float16
    """

    __slots__ = ("_buffer", "_gradients", "_index", "_is_last", "_original", "_parameters")

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
        # The buffer the views were cut from: where their offsets are measured from.
        self._original = buffer
        self._gradients = list(gradients)
        self._parameters = list(parameters)
        self._is_last = is_last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """One tensor per parameter, shaped like it: views of the current ``buffer()``.

        Raises:
            ValueError: if ``set_buffer`` installed a tensor that is not flat or is shorter
                than the bucket (its slots would fall outside it).
        """
        if self._buffer is self._original:
            return list(self._gradients)
        # Only after set_buffer: cut the same slots out of the replacement, as DDP does. The
        # offsets are derived here, not at construction, so a bucket whose buffer is never
        # replaced (every hook but a wrapper) pays nothing per parameter.
        buffer = self._buffer
        if buffer.dim() != 1 or buffer.numel() < self._original.numel():
            raise ValueError(
                f"gradients() needs the bucket's buffer to be flat with at least "
                f"{self._original.numel()} elements, but set_buffer installed shape "
                f"{tuple(buffer.shape)}; cast or copy buffer() instead, e.g. "
                "bucket.set_buffer(bucket.buffer().to(torch.float16))"
            )
        start = self._original.storage_offset()
        return [
            buffer.narrow(0, view.storage_offset() - start, view.numel()).view(view.shape)
            for view in self._gradients
        ]

    def parameters(self) -> list[torch.Tensor]:
        return list(self._parameters)

    def is_last(self) -> bool:
        return self._is_last

    def set_buffer(self, tensor: torch.Tensor) -> None:
        """Replace the flat tensor; ``buffer()`` and ``gradients()`` then read ``tensor``."""
        self._buffer = tensor


def _group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    return process_group if process_group is not None else cast(dist.ProcessGroup, dist.group.WORLD)


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


def in_bucket_order(hook: CommHook) -> CommHook:
    """``hook``, each bucket's reduction started only once the previous bucket's is done.

    Compressing PowerSGD issues two of its three all-reduces per bucket from its futures'
    callbacks, which gloo runs on its own thread: with several buckets in flight, the order of
    those all-reduces on the group depends on timing and differs between ranks, which hangs
    (torch DDP hangs too). Started in bucket order, each bucket's collectives all complete
    before the next bucket's first one is issued, so every rank issues them in one order. The
    arithmetic is the hook's own: only when it runs changes. Backward is not blocked: a later
    bucket's hook runs from the earlier bucket's future callback. Buckets must be launched
    in index order, bucket 0 first in each step (as DDP and ``DataParallel`` launch them).

    Args:
        hook: a comm hook (``hook(state, bucket) -> Future[Tensor]``).

    Returns:
        A comm hook with the same results.

    Example:
        >>> ddp.register_comm_hook(state, in_bucket_order(powerSGD_hook))  # doctest: +SKIP
    """
    previous: list[torch.futures.Future[Any] | None] = [None]

    def ordered(state: Any, bucket: Any) -> torch.futures.Future[Any]:
        before = None if bucket.index() == 0 else previous[0]
        if before is None or before.done():
            future = hook(state, bucket)
        else:
            future = torch.futures.Future()
            before.add_done_callback(lambda _: _forward(hook, state, bucket, future))
        previous[0] = future
        return future

    # DDP's register_comm_hook checks the annotations as objects; postponed evaluation (this
    # module's ``from __future__ import annotations``) leaves strings, which it refuses.
    ordered.__annotations__ = {
        "state": Any,
        "bucket": dist.GradBucket,
        "return": torch.futures.Future[torch.Tensor],
    }
    return ordered


def _forward(hook: CommHook, state: Any, bucket: Any, future: torch.futures.Future[Any]) -> None:
    """Run ``hook`` and hand its future's value (or error) to ``future``."""

    def done(inner: torch.futures.Future[Any]) -> None:
        try:
            future.set_result(inner.value())
        except Exception as error:  # the hook's collective failed: the waiter raises it
            future.set_exception(error)

    try:
        hook(state, bucket).add_done_callback(done)
    except Exception as error:
        future.set_exception(error)
