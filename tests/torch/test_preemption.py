"""Preemption in torch: SIGTERM to one rank of two (a scheduler's warning reaches the ranks
at different moments; here it reaches one only) makes both save at the same step boundary,
wait for the save and exit with 143; the checkpoint holds that step's state, bitwise, at
world size 1 and in JAX (tests/torch/preemption_worker.py).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gradsync_core import PREEMPTED_EXIT, read_manifest
from tests.faults.async_save_loads import assert_loads_everywhere

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120


@pytest.mark.slow
def test_sigterm_saves_at_the_same_step_on_every_rank_and_exits_143(tmp_path: Path) -> None:
    path = tmp_path / "ckpt"
    worker = ROOT / "tests" / "torch" / "preemption_worker.py"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen(
            [sys.executable, str(worker), str(r), "2", str(tmp_path / "store"), str(path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(2)
    ]
    try:
        seen: list[list[str]] = [[], []]
        for rank, p in enumerate(procs):
            assert p.stdout is not None
            for line in p.stdout:
                seen[rank].append(line)
                if line == "training\n":
                    break
        procs[1].send_signal(signal.SIGTERM)
        outputs = [
            "".join(seen[r]) + p.communicate(timeout=TIMEOUT_S)[0] for r, p in enumerate(procs)
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for rank, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == PREEMPTED_EXIT, f"rank {rank} exited {p.returncode}:\n{text}"
    saving = [[line for line in t.splitlines() if line.startswith("saving at")] for t in outputs]
    assert saving[0] == saving[1] and len(saving[0]) == 1, saving
    step = int(saving[0][0].rsplit(" ", 1)[1])
    assert read_manifest(path).step == step + 1  # ZeRO counts the steps taken
    assert_loads_everywhere(path, dict(np.load(f"{path}.npz")), "preempted")
