"""Muon under every sharding, exactly: gradsync_torch.MatrixOptimizer (docs/matrix-optimizers.md).

A GPT (examples/pipeline_models.py) trained 5 steps with Muon on its hidden matrices and AdamW
on the rest, at 2 and 4 gloo ranks, under ZeRO-3 (``fully_shard``), ZeRO-1 and ZeRO-2: bitwise
equal to a plain Muon fed the same reduced gradients (parameters and momentum), and within the
reduction-order floor of one process on the full batch (tests/torch/matrix_checks.py).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.support.harness import run_workers
from tests.torch.matrix_checks import (
    largest_difference,
    load_and_continue,
    one_process,
    pair,
    reference,
    refusals,
    save_after,
)

SHARDINGS = ("zero3", "zero1", "zero2")


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_matrix_step_is_bitwise_the_plain_optimizer(sharding: str) -> None:
    """At 4 ranks (at 2 the whole run is one process's, below), given the gradients the
    sharded run reduced, every step is the plain optimizer's, bit for bit."""
    results = run_workers(pair, 4, sharding, timeout=300)
    assert len({r["fingerprint"] for r in results}) == 1
    assert all(r["matrices"] == 8 for r in results)
    if sharding == "zero3":  # the all-to-alls move what the plan predicts
        for r in results:
            assert r["exchanged"] == r["predicted"]


@pytest.fixture(scope="module")
def floor_at_4() -> tuple[dict[str, torch.Tensor], float]:
    """One process on the full batch, and how far one process moves from it when only the
    order of the 4 slices' gradient sum changes (the reduction-order floor: Muon runs
    Newton-Schulz in bfloat16, so a last-bit change of a gradient can move an update by a
    bfloat16 ulp, about 1e-3 after 5 steps here)."""
    full = one_process(1)
    orders = ([0, 1, 2, 3], [3, 2, 1, 0], [1, 0, 3, 2], [2, 3, 0, 1])
    return full, max(largest_difference(one_process(4, o), full) for o in orders)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_matrix_optimizer_at_2_ranks_is_one_process_bitwise(sharding: str) -> None:
    """At 2 ranks every reduction adds two halves, whose sum has one order: the sharded run
    is one process summing the two slices' gradients, bit for bit."""
    sharded = run_workers(reference, 2, sharding, timeout=300)[0]
    expected = one_process(2)
    for key, value in expected.items():
        mine = torch.as_tensor(sharded[key])
        assert torch.equal(mine, value), (
            f"{sharding}: {key} differs by {(mine - value).abs().max().item():.3g}"
        )


@pytest.mark.slow
@pytest.mark.parametrize("sharding", SHARDINGS)
def test_matrix_optimizer_at_4_ranks_within_the_floor(
    sharding: str, floor_at_4: tuple[dict[str, torch.Tensor], float]
) -> None:
    full, floor = floor_at_4
    sharded = run_workers(reference, 4, sharding, timeout=300)[0]
    worst = largest_difference(sharded, full)
    assert worst <= 2 * floor, f"{sharding}: {worst:.3g} from one process, floor {floor:.3g}"


@pytest.mark.slow
@pytest.mark.parametrize("resume", ["zero3", "zero1"])
def test_checkpoint_continues_at_another_world_size(
    resume: str, tmp_path: Any, floor_at_4: tuple[dict[str, torch.Tensor], float]
) -> None:
    """Saved under ZeRO-3 at 4 ranks after 3 steps, loaded at 2 ranks (ZeRO-3, or ZeRO-1 on
    whole tensors): the state comes back bit for bit in model space (every matrix now with
    another owner), and 2 more steps land within the floor of one process's 5."""
    saved = run_workers(save_after, 4, "zero3", str(tmp_path), 3, timeout=300)[0]
    loaded, final = run_workers(load_and_continue, 2, resume, str(tmp_path), 3, timeout=300)[0]
    assert saved.keys() == loaded.keys()
    for key in saved:
        assert (saved[key] == loaded[key]).all(), f"{key} changed through the checkpoint"
    full, floor = floor_at_4
    worst = largest_difference(final, full)
    assert worst <= 2 * floor, f"resumed under {resume}: {worst:.3g} from one process"


def test_refusals() -> None:
    run_workers(refusals, 2, timeout=120)
