"""The gradient-averaging rule of a sharded reduction: FSDP2's, so results are bitwise equal.

FSDP2 (torch 2.13, ``_fsdp_collectives._get_gradient_divide_factors``) averages the
reduce-scatter of ``float32``/``bfloat16`` gradients inside the collective
(``ReduceOp.AVG``; ``SUM`` on one rank, where AVG may be wrong on NCCL); for other dtypes
(``float16``), whose range could overflow the sum, it divides by a power of two ``pre``
before the sum and by ``N / pre`` after it, with ``pre`` the largest power of two such that
``pre`` divides ``N`` and ``N / pre > pre`` holds before the last doubling (about ``sqrt(N)``).
A user's divide factor (``set_gradient_divide_factor``; torchtitan sets 1.0 and divides the
loss itself) replaces ``N``: the reduce-scatter then multiplies each rank's input by
``1 / factor`` inside the collective (``PREMUL_SUM``; ``AVG`` when the factor is the shard
group's size) and the HSDP all-reduce sums; ``set_force_sum_reduction_for_comms`` makes both
collectives plain sums and divides by the factor after them. gradsync issues the same
collectives with the same operations and factors, so the bytes match (docs/torch-zero3.md,
"Arithmetic").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class Divide(NamedTuple):
    """Divide by ``pre`` before the collective, reduce-scatter with ``op`` and all-reduce (HSDP)
    with ``all_reduce_op``, divide by ``post`` after. ``scale``: ``op`` is
    ``PREMUL_SUM(scale)``, each rank's input times ``scale`` inside the sum."""

    pre: float | None
    post: float | None
    op: object  # a dist.ReduceOp
    all_reduce_op: object
    scale: float | None = None


def gradient_divide(
    reduce_dtype: torch.dtype,
    world_size: int,
    *,
    shard_size: int | None = None,
    factor: float | None = None,
    force_sum: bool = False,
) -> Divide:
    """FSDP2's divide factors and reduce ops for a mean over ``world_size`` ranks.

    Args:
        reduce_dtype: the dtype the gradients are reduced in.
        world_size: the data-parallel ranks the mean is over (HSDP: shard x replicate).
        shard_size: the reduce-scatter group's ranks (default ``world_size``: no HSDP).
        factor: divide by this instead of ``world_size`` (``set_gradient_divide_factor``).
        force_sum: sum in both collectives, dividing outside them
            (``set_force_sum_reduction_for_comms``).

    Example:
        >>> gradient_divide(torch.float32, 4).op == dist.ReduceOp.AVG
        True
        >>> gradient_divide(torch.float16, 8)[:2]
        (4, 2.0)
        >>> gradient_divide(torch.float32, 4, factor=1.0).scale
        1.0
    """
    shard_size = world_size if shard_size is None else shard_size
    overflow = reduce_dtype not in (torch.float32, torch.bfloat16)
    if not overflow and not force_sum:
        # Neither dtype can overflow the sum of N gradients, so the collective divides.
        if factor is None:
            op = dist.ReduceOp.SUM if world_size == 1 else dist.ReduceOp.AVG
            return Divide(None, None, op, op)
        if factor == shard_size:
            return Divide(None, None, dist.ReduceOp.AVG, dist.ReduceOp.SUM)
        scale = 1 / factor
        return Divide(None, None, dist.ReduceOp.PREMUL_SUM(scale), dist.ReduceOp.SUM, scale)
    total = float(world_size) if factor is None else factor
    if not overflow:
        return Divide(None, total, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return Divide(pre, total / pre, dist.ReduceOp.SUM, dist.ReduceOp.SUM)
