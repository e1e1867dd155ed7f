"""The single-process rules of gradsync's fully_shard: FSDP2's divide factors, argument errors."""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

from gradsync_torch import MixedPrecisionPolicy
from gradsync_torch.param_sharding import gradient_divide


class _Group:
    def __init__(self, size: int) -> None:
        self._size = size

    def size(self) -> int:
        return self._size


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 6, 8, 16, 24])
def test_divide_factors_are_fsdp2s(dtype, world_size):
    theirs = _get_gradient_divide_factors(_Group(world_size), None, dtype, "cpu")
    assert gradient_divide(dtype, world_size)[:4] == theirs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shard, replicate", [(1, 2), (2, 1), (2, 2), (3, 1), (4, 2), (8, 1)])
@pytest.mark.parametrize("factor", [None, 0.5, 1.0, 2.0, 3.0, 4.0])
@pytest.mark.parametrize("force_sum", [False, True], ids=["avg", "force-sum"])
def test_divide_factor_and_force_sum_are_fsdp2s(dtype, shard, replicate, factor, force_sum):
    """set_gradient_divide_factor / set_force_sum_reduction_for_comms: FSDP2's factors and
    ops, HSDP's all-reduce op included; PREMUL_SUM's scale is 1 / factor."""
    theirs = _get_gradient_divide_factors(
        _Group(shard), _Group(replicate) if replicate > 1 else None, dtype, "cpu", factor, force_sum
    )
    ours = gradient_divide(
        dtype, shard * replicate, dp_shard=shard, factor=factor, force_sum=force_sum
    )
    assert ours[:4] == theirs
    # ReduceOp.PREMUL_SUM(a) == ReduceOp.PREMUL_SUM(b) for any a, b: compare the scale itself.
    premul = factor is not None and factor != shard and not force_sum and dtype != torch.float16
    assert ours.scale == (1 / factor if premul else None)


def test_shard_size_is_the_deprecated_spelling_of_dp_shard(deprecations):
    new = gradient_divide(torch.float32, 8, dp_shard=4, factor=4.0)
    assert deprecations.messages == []
    assert gradient_divide(torch.float32, 8, shard_size=4, factor=4.0)[:4] == new[:4]
    assert gradient_divide(torch.float32, 8, shard_size=4, factor=4.0)[:4] == new[:4]
    assert deprecations.messages == [
        "gradient_divide(shard_size=) is deprecated and will be removed: use "
        "gradient_divide(dp_shard=)"
    ]
    with pytest.raises(TypeError, match="got dp_shard= and its deprecated spelling"):
        gradient_divide(torch.float32, 8, shard_size=4, dp_shard=4)


def test_policy_refuses_a_non_float_dtype():
    with pytest.raises(ValueError, match=r"param_dtype must be a floating torch\.dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)


def test_fully_shard_needs_a_process_group():
    from gradsync_torch import fully_shard

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(torch.nn.Linear(2, 2))
