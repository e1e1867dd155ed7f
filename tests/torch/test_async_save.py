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

from tests.torch import async_save_checks as checks
from tests.torch.harness import run_workers

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


def test_a_zero3_save_in_the_background_holds_the_state_at_the_call(tmp_path) -> None:
    at_call = run_workers(checks.param_shards_check, WORLD, str(tmp_path), timeout=240)[0]
    got = checks.plain_state(str(tmp_path / "zero3"))
    checks.assert_same(got, at_call, "ZeRO-3 at world size 1")
