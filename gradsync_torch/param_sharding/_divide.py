"""The gradient-averaging rule of a sharded reduction: FSDP2's, so results are bitwise equal.

FSDP2 (torch 2.13, ``_fsdp_collectives._get_gradient_divide_factors``) averages the
reduce-scatter of ``float32``/``bfloat16`` gradients inside the collective
(``ReduceOp.AVG``; ``SUM`` on one rank, where AVG may be wrong on NCCL); for other dtypes
(``float16``), whose range could overflow the sum, it divides by a power of two ``pre``
before the sum and by ``N / pre`` after it, with ``pre`` the largest power of two such that
``pre`` divides ``N`` and ``N / pre > pre`` holds before the last doubling (about ``sqrt(N)``).
gradsync issues the same collective with the same operation and the same factors, so the
bytes match on every backend (docs/torch-zero3.md, "Arithmetic").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist


class Divide(NamedTuple):
    """Divide by ``pre`` before the collective, reduce with ``op``, divide by ``post`` after."""

    pre: float | None
    post: float | None
    op: object  # a dist.ReduceOp


def gradient_divide(reduce_dtype: torch.dtype, world_size: int) -> Divide:
    """FSDP2's divide factors and reduce op for a mean over ``world_size`` ranks.

    Example:
        >>> gradient_divide(torch.float32, 4).op == dist.ReduceOp.AVG
        True
        >>> gradient_divide(torch.float16, 8)[:2]
        (4, 2.0)
    """
    if reduce_dtype in (torch.float32, torch.bfloat16):
        # Neither can overflow the sum of N gradients, so the collective averages.
        op = dist.ReduceOp.SUM if world_size == 1 else dist.ReduceOp.AVG
        return Divide(None, None, op)
    factor = float(world_size)
    pre = 1
    while factor % pre == 0 and factor / pre > pre:
        pre *= 2
    return Divide(pre, factor / pre, dist.ReduceOp.SUM)
