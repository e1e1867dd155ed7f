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
    pre, post, op, _ = _get_gradient_divide_factors(_Group(world_size), None, dtype, "cpu")
    assert gradient_divide(dtype, world_size) == (pre, post, op)


def test_policy_refuses_a_non_float_dtype():
    with pytest.raises(ValueError, match=r"param_dtype must be a floating torch\.dtype"):
        MixedPrecisionPolicy(param_dtype=torch.int8)


def test_fully_shard_needs_a_process_group():
    from gradsync_torch import fully_shard

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group"):
        fully_shard(torch.nn.Linear(2, 2))
