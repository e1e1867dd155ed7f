"""Saves in the background and preemption with 2 JAX processes x 2 CPU devices (docs/
checkpoints.md): the background agreement runs through the distributed key-value store while
training's collectives go on; a full disk on process 1 reaches both as one sentence; the store
keeps only the last save's keys; a SIGTERM to both processes makes them save at the same step
and exit with 143 (tests/jax/async_multiprocess_worker.py).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from gradsync_core import PREEMPTED_EXIT, read_manifest
from gradsync_jax import load_optimizer_state, shard_optimizer
from tests.jax import async_multiprocess_worker as worker
from tests.jax.distributed_start import ROOT
from tests.jax.zero_checkpoint_problem import params0
from tests.support.meshes import mesh_of
from tests.support.ports import free_port

pytestmark = pytest.mark.slow  # 2 processes started and joined: 11 s
TIMEOUT_S = 180


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> tuple[Path, list[str]]:
    out = tmp_path_factory.mktemp("async_multiprocess")
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, worker.__file__, str(i), "2", str(port), str(out)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        seen = [[], []]
        for i, p in enumerate(procs):  # both train under the handler: now the scheduler
            assert p.stdout is not None
            for line in p.stdout:
                seen[i].append(line)
                if line == "training\n":
                    break
        for p in procs:
            p.send_signal(signal.SIGTERM)
        outputs = [
            "".join(seen[i]) + p.communicate(timeout=TIMEOUT_S)[0] for i, p in enumerate(procs)
        ]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == PREEMPTED_EXIT, (
            f"process {i} exited with {p.returncode}:\n{text[-4000:]}"
        )
    return out, outputs


def _loads_bitwise(path: Path, npz: Path) -> None:
    params = jax.tree.map(np.asarray, params0())
    eight = shard_optimizer(optax.adam(1e-2), mesh_of(8))  # saved on 2 x 2: another count
    loaded, _ = load_optimizer_state(path, eight, params)
    got = [np.asarray(v) for v in jax.tree.leaves(eight.gather_state(loaded, params))]
    want = dict(np.load(npz))
    assert len(got) == len(want)
    for i, value in enumerate(got):
        assert np.array_equal(value, want[f"state_{i}"]), i


def test_a_save_in_the_background_agrees_through_the_key_value_store(run) -> None:
    out, _ = run
    _loads_bitwise(out / "async", out / "async.npz")  # the failed save kept it
    failures = {p: (out / f"failure_{p}.txt").read_text() for p in (0, 1)}
    sentence = (
        f"cannot save optimizer checkpoint {out / 'async'} (process 1): process 1 could not "
        "write its file: OSError: [Errno 28] No space left on device"
    )
    assert failures[1] == f"CheckpointError (cause OSError): {sentence}"
    assert failures[0] == f"CheckpointError (cause None): {sentence}"
    # Three saves in the background: only the last one's keys are left.
    for p in (0, 1):
        keys = json.loads((out / f"keys_{p}.txt").read_text())
        assert keys and {k.split("/")[2] for k in keys} == {"2"}, keys


def test_sigterm_saves_at_the_same_step_on_every_process(run) -> None:
    out, outputs = run
    steps = [
        [line for line in text.splitlines() if line.startswith("saving at step")]
        for text in outputs
    ]
    assert steps[0] == steps[1] and len(steps[0]) == 1, steps
    at = int(steps[0][0].rsplit(" ", 1)[1])
    assert read_manifest(out / "preempted").step == at
    _loads_bitwise(out / "preempted", out / "preempted.npz")
