import pytest
import torch
import torch.distributed as dist

from tests.support.harness import run_workers


def _sum_of_ranks(rank: int, world_size: int) -> float:
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t.item()


def _fail_on_rank_one(rank: int, world_size: int) -> None:
    if rank == 1:
        raise ValueError("boom on rank one")


def test_all_reduce_across_spawned_ranks():
    assert run_workers(_sum_of_ranks, 2) == [1.0, 1.0]


def test_worker_failure_is_reraised_with_its_traceback():
    with pytest.raises(AssertionError, match=r"(?s)rank 1 of 2 failed.*boom on rank one"):
        run_workers(_fail_on_rank_one, 2)
