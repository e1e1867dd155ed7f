"""Subprocess tests: 2 processes x 2 CPU devices through jax.distributed on 127.0.0.1 ==
one process; the Flax example script runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from gradsync_core import Topology
from gradsync_jax import data_parallel_step, mesh_from_topology
from tests.jax import multiprocess_worker as worker
from tests.jax.distributed_start import ROOT, TIMEOUT_S, launch

pytestmark = pytest.mark.slow


def _single_process_4_devices():
    """The same training on 4 devices of this process, and the 1-device reference."""
    model, params, batch = worker.make_problem()
    loss_fn = worker.make_loss(model)
    tx = optax.adam(worker.LR)
    devices = sorted(jax.devices(), key=lambda d: d.id)[:4]
    step = data_parallel_step(loss_fn, tx, mesh_from_topology(Topology.create(4), devices))
    p, s = params, tx.init(params)
    rp, rs = params, tx.init(params)
    for _ in range(worker.STEPS):
        p, s, _ = step(p, s, batch)
        grads = jax.grad(loss_fn)(rp, batch)
        updates, rs = tx.update(grads, rs, rp)
        rp = optax.apply_updates(rp, updates)
    return (p, s[0]), (rp, rs[0])


def _flat(result) -> dict[str, np.ndarray]:
    params, adam = result
    out = {f"params_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(params))}
    out |= {f"mu_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(adam.mu))}
    out |= {f"nu_{i}": np.asarray(a) for i, a in enumerate(jax.tree.leaves(adam.nu))}
    return out


def test_two_processes_match_one_process(tmp_path: Path) -> None:
    launch(worker.__file__, tmp_path)
    results = [dict(np.load(tmp_path / f"process_{i}.npz")) for i in range(2)]
    # Both processes hold the same replicated result, bit for bit.
    for key in results[0]:
        np.testing.assert_array_equal(results[0][key], results[1][key], err_msg=key)
    got = results[0]
    assert int(got["count"]) == worker.STEPS
    assert got["device_ids"].tolist() == sorted(got["device_ids"].tolist())  # placed by rank
    in_process, reference = (_flat(r) for r in _single_process_4_devices())
    assert set(in_process) == {k for k in got if k.split("_")[0] in ("params", "mu", "nu")}
    for key, expected in in_process.items():
        # Cross-process (gloo) and in-process all-reduce may add in another order.
        np.testing.assert_allclose(
            got[key], expected, rtol=1e-6, atol=1e-6 * np.abs(expected).max(), err_msg=key
        )
        ref = reference[key]
        np.testing.assert_allclose(
            got[key], ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(), err_msg=key
        )


def test_flax_example_trains() -> None:
    """examples/flax_dp_train.py (nnx, 4 devices, accumulation) runs and its loss falls 4x."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    script = ROOT / "examples" / "flax_dp_train.py"
    args = ["--steps", "20", "--accumulate", "2", "--devices", "4"]
    done = subprocess.run(
        [sys.executable, str(script), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "mesh {'pp': 1, 'dp': 4" in done.stdout
