"""The divide-after-sum rule (docs/design.md §7): where a mean over n devices divides.

Dividing the sum by n gives the same bits as summing the divided values only when n is a
power of two (scaling by 2**-k is exact and commutes with rounding) and the dtype has
float32's exponent range or more (the sum of n values that each fit cannot overflow:
float16's largest value is 65504, bfloat16 shares float32's range).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from gradsync_jax._axes import divide_after

# dtype -> n -> may the mean divide after the sum?
RULE = {
    "float32": {2: True, 3: False, 4: True, 8: True},
    "bfloat16": {2: True, 3: False, 4: True, 8: True},
    "float16": {2: False, 3: False, 4: False, 8: False},
}
CASES = [(dtype, n, after) for dtype, by_n in RULE.items() for n, after in by_n.items()]


@pytest.mark.parametrize(("dtype", "n", "after"), CASES, ids=[f"{d}-n{n}" for d, n, _ in CASES])
def test_rule(dtype: str, n: int, after: bool) -> None:
    assert divide_after(jnp.dtype(dtype), n) is after
    assert divide_after(dtype, n) is after  # a dtype name works too


def _sequential_sum(values: jnp.ndarray) -> jnp.ndarray:
    total = values[0]
    for v in values[1:]:
        total = total + v  # rounded to the dtype at every step, as a ring all-reduce does
    return total


@pytest.mark.parametrize(("dtype", "n", "after"), [c for c in CASES if c[2]])
def test_dividing_after_is_bitwise_equal_where_the_rule_allows(
    dtype: str, n: int, after: bool
) -> None:
    rng = np.random.default_rng(n)
    values = jnp.asarray(rng.normal(size=(n, 4096)), dtype)
    before = _sequential_sum(values / n)
    divided_after = _sequential_sum(values) * (1.0 / n)
    np.testing.assert_array_equal(np.asarray(divided_after), np.asarray(before))


def test_float16_sum_overflows_where_dividing_first_does_not() -> None:
    values = jnp.full((8, 4), 30000.0, jnp.float16)  # each fits; their sum does not
    assert bool(jnp.isinf(_sequential_sum(values)).all())
    assert bool(jnp.isfinite(_sequential_sum(values / 8)).all())


def test_non_power_of_two_division_rounds_differently() -> None:
    rng = np.random.default_rng(3)
    values = jnp.asarray(rng.normal(size=(3, 4096)), jnp.float32)
    before = np.asarray(_sequential_sum(values / 3))
    after = np.asarray(_sequential_sum(values) * (1.0 / 3))
    assert not np.array_equal(before, after)


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize(("replicas", "shards"), [(1, 6), (2, 3), (1, 8)], ids=str)
def test_zero3_float16_gradients_average_as_fsdp2_does(replicas: int, shards: int) -> None:
    """ZeRO-3's backward (``reduce_gradient``) divides a float16 mean as torch's FSDP2 does:
    by its power of two before the sums (reduce-scatter over the shards, all-reduce over the
    replicas) and by the rest after, the factors torch's own function gives; not by ``n``
    before the sum, the ``"after"`` rule's (which rounds every summand at 6 devices)."""
    from jax.sharding import Mesh
    from jax.sharding import PartitionSpec as P
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
        _get_gradient_divide_factors,
    )

    from gradsync_jax.param_sharding.gather import reduce_gradient

    n = replicas * shards
    pre, post, *_ = _get_gradient_divide_factors(
        _Group(shards), _Group(replicas) if replicas > 1 else None, torch.float16, "cpu"
    )
    rng = np.random.default_rng(n)
    # Integers over 4: every division by pre and every partial sum is exact in any order, so
    # the only rounding is FSDP2's last division (and the old rule's first one).
    grads = rng.integers(-8, 9, size=(n, shards * 64)).astype(np.float16)
    mesh = Mesh(np.array(jax.devices()[:n]).reshape(replicas, shards), ("r", "s"))
    replicate = ("r",) if replicas > 1 else ()

    def local(g):
        return reduce_gradient(g[0], ("s",), shards, replicate, mean=True)[None]

    mapped = jax.shard_map(
        local, mesh=mesh, in_specs=P(("r", "s")), out_specs=P(("r", "s")), check_vma=False
    )
    got = np.asarray(jax.jit(mapped)(jnp.asarray(grads))).reshape(replicas, -1)
    want = ((grads / np.float16(pre)).sum(0, dtype=np.float16) / np.float16(post)).astype(
        np.float16
    )
    for replica in got:
        np.testing.assert_array_equal(replica, want)
    if n == 6:  # the "after" rule's float16 mean (dividing first) rounds otherwise
        before = _sequential_sum(jnp.asarray(grads) / n)
        assert not np.array_equal(np.asarray(before), want)
