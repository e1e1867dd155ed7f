"""Where a gradient mean divides: the core's one rule per reduction (docs/design.md §7).

torch's FSDP2 function is compared in tests/torch/test_fully_shard_rules.py (through
``gradient_divide``) and JAX's finfo rule in tests/jax/test_divide_after.py (through
``divide_after``); this pins the table both executors read.
"""

import pytest

from gradsync_core.plan import MEAN_RULES, MeanDivisors, divides_after, mean_divisors

# (dtype, n, rule) -> (pre, post, op, replicate_op)
TABLE = {
    ("float32", 8, "ddp"): (8, None, "sum", "sum"),
    ("float16", 3, "ddp"): (3, None, "sum", "sum"),
    ("float32", 1, "ddp"): (None, None, "sum", "sum"),
    ("float32", 8, "after"): (None, 8, "sum", "sum"),
    ("bfloat16", 4, "after"): (None, 4, "sum", "sum"),
    ("float32", 3, "after"): (3, None, "sum", "sum"),
    ("float16", 8, "after"): (8, None, "sum", "sum"),
    ("float32", 8, "fsdp2"): (None, None, "avg", "avg"),
    ("bfloat16", 3, "fsdp2"): (None, None, "avg", "avg"),
    ("float32", 1, "fsdp2"): (None, None, "sum", "sum"),
    ("float16", 8, "fsdp2"): (4, 2.0, "sum", "sum"),
    ("float16", 6, "fsdp2"): (4, 1.5, "sum", "sum"),  # FSDP2 doubles once past a divisor
    ("float16", 3, "fsdp2"): (2, 1.5, "sum", "sum"),
    ("float16", 16, "fsdp2"): (4, 4.0, "sum", "sum"),
    ("float64", 8, "fsdp2"): (4, 2.0, "sum", "sum"),  # FSDP2 averages float32/bfloat16 only
}


@pytest.mark.parametrize(("key", "want"), list(TABLE.items()), ids=[str(k) for k in TABLE])
def test_the_rules(key, want):
    assert tuple(mean_divisors(*key)[:4]) == want


@pytest.mark.parametrize("n", range(1, 65))
def test_fsdp2_splits_float16_into_a_power_of_two_and_the_rest(n):
    """FSDP2's loop: double ``pre`` from 1 while ``pre`` divides n and ``n / pre > pre``."""
    pre, post, *_ = mean_divisors("float16", n, "fsdp2")
    assert pre & (pre - 1) == 0 and pre * post == n
    assert n % (pre // 2 or 1) == 0 and pre <= 2 * n**0.5 + 1  # about sqrt(n)


def test_fsdp2_factor_and_force_sum():
    assert mean_divisors("float32", 8, "fsdp2", shard=4, factor=4.0) == MeanDivisors(
        None, None, "avg", "sum"
    )
    assert mean_divisors("float32", 8, "fsdp2", factor=2.0) == MeanDivisors(
        None, None, "premul_sum", "sum", 0.5
    )
    assert mean_divisors("float32", 8, "fsdp2", force_sum=True) == MeanDivisors(None, 8.0)
    assert mean_divisors("float16", 8, "fsdp2", factor=1.0)[:2] == (1, 1.0)


def test_divides_after_is_the_after_rule():
    for dtype in ("float32", "float64", "bfloat16", "float16", "float8_e4m3fn"):
        for n in range(2, 17):
            assert divides_after(dtype, n) is (mean_divisors(dtype, n, "after").post is not None)


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("float32", 8, "mean"), {}, "unknown mean rule 'mean'"),
        (("int32", 8, "ddp"), {}, "needs a floating dtype name"),
        (("float32", 0, "after"), {}, "positive int of ranks"),
        (("float32", 8, "ddp"), {"factor": 2.0}, "are FSDP2's; rule 'ddp' has none"),
    ],
    ids=["rule", "dtype", "n", "fsdp2-option"],
)
def test_bad_input(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        mean_divisors(*args, **kwargs)


def test_the_rules_are_named():
    assert MEAN_RULES == ("ddp", "after", "fsdp2")
