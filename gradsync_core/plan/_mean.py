"""Where a gradient mean divides: one rule per reduction, for both executors (docs/design.md §7).

A mean over ``n`` ranks is a sum and a division by ``n``; where the division goes decides the
bits (rounding) and the range (a narrow sum can overflow). Each reduction names its rule:

- ``"ddp"``: torch DDP's Reducer, every rank's input divided by ``n`` before the sum (the data-
  parallel all-reduce and ZeRO-1/2's reduce-scatter in torch);
- ``"after"``: the same mean with the division moved after the sum where that gives the same
  bits, ``n`` a power of two and a dtype with float32's exponent range, else before as
  ``"ddp"`` (the same reductions in JAX, where XLA fuses the late division);
- ``"fsdp2"``: FSDP2's reduce-scatter and HSDP all-reduce (torch 2.13's
  ``_fsdp_collectives._get_gradient_divide_factors``): float32 and bfloat16 average inside the
  collective (``AVG``), any other dtype divides by a power of two ``pre`` (about ``sqrt(n)``)
  before the sum and by ``n / pre`` after it (ZeRO-3 in both executors).
"""

from __future__ import annotations

from typing import NamedTuple

MEAN_RULES = ("ddp", "after", "fsdp2")
# Dtypes with float32's exponent range or more: a sum of n values that each fit cannot
# overflow (n < 2**64), so dividing after it is safe (numpy/ml_dtypes finfo maxexp >= 128).
_WIDE = frozenset({"float32", "float64", "bfloat16", "complex64", "complex128", "float8_e8m0fnu"})
# FSDP2 averages inside the collective only for these; every other dtype is an overflow risk.
_FSDP2_AVG = frozenset({"float32", "bfloat16"})


class MeanDivisors(NamedTuple):
    """How one reduction takes a mean: divide each rank's input by ``pre`` before the
    collective, reduce with ``op``, (HSDP) all-reduce across the replicas with
    ``replicate_op``, divide the result by ``post``. ``None`` divides by nothing.

    ``op`` is ``"sum"``, ``"avg"`` (the collective divides by its group's size: NCCL
    multiplies each input by ``1/size``, gloo divides the sum, JAX has no such collective and
    places the division by the ``"after"`` rule) or ``"premul_sum"`` (each input times
    ``scale`` inside the sum).
    """

    pre: float | None
    post: float | None
    op: str = "sum"
    replicate_op: str = "sum"
    scale: float | None = None


def _check(dtype: str, n: int, rule: str) -> None:
    if rule not in MEAN_RULES:
        raise ValueError(f"unknown mean rule {rule!r}; the rules are {MEAN_RULES}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"a mean is over a positive int of ranks, got {n!r}")
    if not isinstance(dtype, str) or not dtype.startswith(("float", "bfloat", "complex")):
        raise ValueError(
            f"a mean divides, so it needs a floating dtype name such as 'float32'; got "
            f"{dtype!r} (sum integers instead, or cast them first)"
        )


def divides_after(dtype: str, n: int) -> bool:
    """Whether ``sum(x) / n`` has the bits of ``sum(x / n)`` for ``dtype``: ``n`` a power of
    two (scaling by ``2**-k`` is exact and commutes with rounding, short of subnormals) and
    float32's exponent range or more (no overflow).

    Example:
        >>> divides_after("bfloat16", 8), divides_after("float16", 8), divides_after("float32", 3)
        (True, False, False)
    """
    _check(dtype, n, "after")
    return n & (n - 1) == 0 and dtype in _WIDE


def mean_divisors(
    dtype: str,
    n: int,
    rule: str,
    *,
    shard: int | None = None,
    factor: float | None = None,
    force_sum: bool = False,
) -> MeanDivisors:
    """The divisions of a mean over ``n`` ranks in ``dtype`` under ``rule`` (``MEAN_RULES``).

    Args:
        dtype: the dtype the values are reduced in, by name (``"float16"``).
        n: the ranks the mean is over (under HSDP: shard group x replicas).
        rule: ``"ddp"``, ``"after"`` or ``"fsdp2"`` (the module docstring).
        shard: ``"fsdp2"`` only: the reduce-scatter group's ranks (default ``n``: no HSDP).
        factor: ``"fsdp2"`` only: divide by this instead of ``n`` (FSDP2's
            ``set_gradient_divide_factor``): ``PREMUL_SUM(1 / factor)`` in the reduce-scatter
            (``AVG`` when it is the shard group's size) and a summing all-reduce.
        force_sum: ``"fsdp2"`` only: both collectives sum, the divisions are outside them
            (FSDP2's ``set_force_sum_reduction_for_comms``).

    Returns:
        A ``MeanDivisors``; FSDP2's numbers and types exactly (its ``pre`` an int).

    Raises:
        ValueError: an unknown rule, a dtype that is not floating, ``n`` not a positive int,
            or FSDP2's options with another rule.

    Example:
        >>> mean_divisors("float16", 8, "fsdp2")[:2], mean_divisors("float16", 8, "after")[:2]
        ((4, 2.0), (8, None))
        >>> mean_divisors("float32", 8, "fsdp2").op, mean_divisors("float32", 8, "after")[:2]
        ('avg', (None, 8))
    """
    _check(dtype, n, rule)
    if rule != "fsdp2":
        if (shard, factor, force_sum) != (None, None, False):
            raise ValueError(f"shard, factor and force_sum are FSDP2's; rule {rule!r} has none")
        if n == 1:
            return MeanDivisors(None, None)
        if rule == "after" and divides_after(dtype, n):
            return MeanDivisors(None, n)
        return MeanDivisors(n, None)
    shard = n if shard is None else shard
    overflow = dtype not in _FSDP2_AVG
    if not overflow and not force_sum:
        # Neither dtype can overflow the sum of n gradients, so the collective divides.
        if factor is None:
            op = "sum" if n == 1 else "avg"  # NCCL's AVG may be wrong on one rank
            return MeanDivisors(None, None, op, op)
        if factor == shard:
            return MeanDivisors(None, None, "avg", "sum")
        return MeanDivisors(None, None, "premul_sum", "sum", 1 / factor)
    total = float(n) if factor is None else factor
    if not overflow:
        return MeanDivisors(None, total)
    pre = 1
    while total % pre == 0 and total / pre > pre:
        pre *= 2
    return MeanDivisors(pre, total / pre)
