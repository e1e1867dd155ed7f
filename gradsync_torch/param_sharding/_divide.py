"""The gradient-averaging rule of a sharded reduction: FSDP2's, so results are bitwise equal.

The rule is the core's ``mean_divisors(dtype, n, "fsdp2")`` (gradsync_core/plan/_mean.py, the
one home of where a mean divides, JAX's ZeRO-3 uses it too), a transcription of torch 2.13's
``_fsdp_collectives._get_gradient_divide_factors``: the reduce-scatter of ``float32``/
``bfloat16`` gradients averages inside the collective (``ReduceOp.AVG``; ``SUM`` on one rank,
where AVG may be wrong on NCCL); other dtypes (``float16``), whose range could overflow the
sum, divide by a power of two ``pre`` before the sum and by ``N / pre`` after it, with ``pre``
the largest power of two such that ``pre`` divides ``N`` and ``N / pre > pre`` holds before
the last doubling (about ``sqrt(N)``). A user's divide factor (``set_gradient_divide_factor``;
torchtitan sets 1.0 and divides the loss itself) replaces ``N``: the reduce-scatter then
multiplies each rank's input by ``1 / factor`` inside the collective (``PREMUL_SUM``; ``AVG``
when the factor is the shard group's size) and the HSDP all-reduce sums;
``set_force_sum_reduction_for_comms`` makes both collectives plain sums and divides by the
factor after them. This module turns the rule into torch's reduce ops, so gradsync issues the
same collectives with the same operations and factors and the bytes match
(docs/torch-zero3.md, "Arithmetic").
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

from gradsync_core.deprecation import deprecated_keywords, renamed_keyword
from gradsync_core.plan import mean_divisors
from gradsync_torch._specs import dtype_name


class Divide(NamedTuple):
    """Divide by ``pre`` before the collective, reduce-scatter with ``op`` and all-reduce (HSDP)
    with ``all_reduce_op``, divide by ``post`` after. ``scale``: ``op`` is
    ``PREMUL_SUM(scale)``, each rank's input times ``scale`` inside the sum."""

    pre: float | None
    post: float | None
    op: object  # a dist.ReduceOp
    all_reduce_op: object
    scale: float | None = None


def _op(name: str, scale: float | None) -> object:
    if name == "premul_sum":
        assert scale is not None  # the rule gives premul_sum with its scale
        return dist.ReduceOp.PREMUL_SUM(scale)
    return {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG}[name]


@deprecated_keywords(shard_size="dp_shard=")
def gradient_divide(
    reduce_dtype: torch.dtype,
    world_size: int,
    *,
    dp_shard: int | None = None,
    factor: float | None = None,
    force_sum: bool = False,
    shard_size: int | None = None,
) -> Divide:
    """FSDP2's divide factors and reduce ops for a mean over ``world_size`` ranks.

    Args:
        reduce_dtype: the dtype the gradients are reduced in.
        world_size: the data-parallel ranks the mean is over (HSDP: shard x replicate).
        dp_shard: the reduce-scatter group's ranks (default ``world_size``: no HSDP).
        factor: divide by this instead of ``world_size`` (``set_gradient_divide_factor``).
        force_sum: sum in both collectives, dividing outside them
            (``set_force_sum_reduction_for_comms``).
        shard_size: the deprecated spelling of ``dp_shard``.

    Example:
        >>> gradient_divide(torch.float32, 4).op == dist.ReduceOp.AVG
        True
        >>> gradient_divide(torch.float16, 8)[:2]
        (4, 2.0)
        >>> gradient_divide(torch.float32, 4, factor=1.0).scale
        1.0
    """
    dp_shard = renamed_keyword("gradient_divide", "shard_size", shard_size, "dp_shard", dp_shard)
    return _divide(reduce_dtype, world_size, dp_shard, factor, force_sum)


@functools.lru_cache(maxsize=256)
def _divide(
    reduce_dtype: torch.dtype,
    world_size: int,
    dp_shard: int | None,
    factor: float | None,
    force_sum: bool,
) -> Divide:
    """``gradient_divide``'s answer, once per argument set: every unit asks at every step."""
    rule = mean_divisors(
        dtype_name(reduce_dtype),
        world_size,
        "fsdp2",
        shard=dp_shard,
        factor=factor,
        force_sum=force_sum,
    )
    return Divide(
        rule.pre,
        rule.post,
        _op(rule.op, rule.scale),
        _op(rule.replicate_op, rule.scale),
        rule.scale,
    )
