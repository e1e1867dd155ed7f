"""Saves that do not stop training in torch (``blocking=False``; docs/checkpoints.md).

On 2 gloo ranks: ZeRO-1, ZeRO-2 and ZeRO-3 saves return before their files are written,
training goes on (its state changed in place, its all-reduces beside the writer's own
collectives) and the checkpoints hold the state at the call, bitwise, loaded at world size 1
and at 2; the staging buffer is allocated once, sized as ``gradsync plan --zero 1`` prints,
and the background agrees over one gloo group of its own (tests/torch/async_save_checks.py).
"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from gradsync_torch import load_optimizer_state_dict
from tests.support.harness import run_workers
from tests.torch import async_save_checks as checks

WORLD = 2


def _plan_staging() -> list[dict[str, int]]:
    """``gradsync plan --zero 1``'s save staging for the tests' model over 2 ranks."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "gradsync_core",
            "plan",
            "--model",
            "tests.torch.async_save_checks:linear_model",
            "--zero",
            "1",
            "--world-size",
            str(WORLD),
            "--partition",
            "greedy",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return json.loads(done.stdout)["save_staging"]


@pytest.mark.slow
def test_saves_in_the_background_hold_the_state_at_the_call(tmp_path) -> None:
    results = run_workers(checks.api_checks, WORLD, str(tmp_path), timeout=240)
    planned = _plan_staging()
    for rank, result in enumerate(results):
        # Planned, not guessed: the buffer is exactly what the plan prints for the rank.
        assert result["staged state bytes"] == planned[rank]["state_bytes"], (rank, planned)
        with_weights = planned[rank]["state_bytes"] + planned[rank]["weight_bytes"]
        assert result["staged bytes with weights"] == with_weights, (rank, planned)
        # One group for every background save of the training group, made at the first.
        assert result["background groups"] == 1
        assert result["background groups after ZeRO-2"] == 1


def test_a_save_agrees_in_three_collectives(tmp_path) -> None:
    """Each collective of a background save costs the training a core and the interpreter
    lock (docs/checkpoints.md): the switching save agrees in three rounds (prepared and the
    token; written, with the digests and records; switched), each one collective when its
    answers are small (two when one is longer), and a background save runs none on the
    training's group."""
    counts = run_workers(checks.collective_counts, WORLD, str(tmp_path), timeout=120)
    for rank, count in enumerate(counts):
        assert count == {
            "background": 3,
            "training during a background save": 0,
            "blocking": 3,
            "a longer answer": 2,
        }, (rank, count)


def test_a_zero3_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    at_call = run_workers(checks.param_shards_check, WORLD, str(tmp_path), timeout=240)[0]
    got = checks.plain_state(str(tmp_path / "zero3"))
    checks.assert_same(got, at_call, "ZeRO-3 at world size 1")


def test_a_matrix_optimizer_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    run_workers(checks.matrix_check, WORLD, str(tmp_path), timeout=240)


def test_a_pipeline_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    """Rank 0 writes the whole model in the background; every rank's handle gets the
    manifest, or the same sentence when that write fails; the checkpoint loads into the
    unpipelined model (weights and AdamW state) as they were at the call, bitwise."""
    from examples.pipeline_models import gpt_blocks
    from gradsync_torch import load_model_weights

    results = run_workers(checks.pipeline_check, WORLD, str(tmp_path), timeout=240)
    at_call = {k: v for result in results for k, v in result["at call"].items()}
    assert {r["step"] for r in results} == {checks.SAVED_STEPS}
    raised = {r["raised"] for r in results}
    assert len(raised) == 1, raised  # one sentence, on every rank
    (sentence,) = raised
    assert sentence is not None and sentence.startswith(
        f"cannot save pipeline checkpoint {tmp_path / 'full'}"
    ), sentence
    assert "No space left on device" in sentence
    assert not (tmp_path / "full").exists()

    model = gpt_blocks(seed=1)
    load_model_weights(str(tmp_path / "pipeline"), model)
    got = {n: p.detach().numpy().copy() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    state = load_optimizer_state_dict(str(tmp_path / "pipeline"), opt, model)
    names = [n for n, _ in model.named_parameters()]
    for index, entries in state["state"].items():
        for key, value in entries.items():
            got[f"{names[index]}/{key}"] = np.asarray(value).copy()
    checks.assert_same(got, at_call, "the pipeline at the call")
