import pytest
import torch
import torch.distributed as dist

from tests.support.harness import Skip, run_checks, run_workers


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


def _checks_that_fail_and_skip(rank: int, world_size: int) -> list[dict[str, str | None]]:
    def fail_on_rank_one() -> None:
        assert rank != 1, "rank one's check failed"

    def skip_everywhere() -> None:
        raise Skip("does not apply here")

    def skip_on_rank_zero() -> None:
        if rank == 0:
            raise Skip("only rank zero skips")

    checks = [
        ("passes", lambda: None),
        ("fails on rank 1", fail_on_rank_one),
        ("skipped", skip_everywhere),
        ("skipped on rank 0 only", skip_on_rank_zero),
        ("passes after", lambda: None),
    ]
    return [run_checks(checks), run_checks(checks, keep_going=True)]


def test_run_checks_agrees_on_failures_and_skips():
    ranks = run_workers(_checks_that_fail_and_skip, 2)
    for rank, (stopped, kept_going) in enumerate(ranks):
        assert stopped["passes"] is None and kept_going["passes"] is None
        failure = "rank one's check failed" if rank == 1 else "failed on another rank"
        assert failure in stopped["fails on rank 1"] and failure in kept_going["fails on rank 1"]
        # After a failure the ranks may be out of step: the rest is not run ...
        assert all(stopped[n].startswith("not run") for n in list(stopped)[2:])
        # ... unless the checks are independent (keep_going): a skip agreed by every rank is
        # a skip, one rank's skip is a failure on both, and the checks after it run.
        assert kept_going["skipped"] == "skipped: does not apply here"
        alone = "skipped here, not on every rank" if rank == 0 else "passed here, not on every"
        assert kept_going["skipped on rank 0 only"].startswith(alone)
        assert kept_going["passes after"] is None
