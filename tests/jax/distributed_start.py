"""A multi-process JAX job on one machine (``jax.distributed`` on 127.0.0.1), both halves.

``launch`` (the test) runs a worker script as ``num_processes`` processes; ``start_process``
(the worker, before anything else touches JAX) joins this process to the job. Imports no
framework, so the worker may import it first.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 90


def launch(worker: str, out_dir: Path, num_processes: int = 2, *args: str) -> None:
    """Run ``python worker PROCESS_ID NUM_PROCESSES PORT OUT_DIR *args`` once per process, with
    this tree on ``PYTHONPATH`` and the worker choosing its own devices (no ``XLA_FLAGS``), and
    wait ``TIMEOUT_S`` for all of them.

    Raises:
        AssertionError: a process exited non-zero (its output's tail is in the message).
        subprocess.TimeoutExpired: a process did not finish; every process is killed first.
    """
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, worker, str(i), str(num_processes), str(port), str(out_dir), *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(num_processes)
    ]
    try:
        outputs = [p.communicate(timeout=TIMEOUT_S)[0] for p in procs]
    finally:
        for p in procs:  # a failed peer leaves the other waiting in a collective
            if p.poll() is None:
                p.kill()
                p.communicate()
    for i, (p, text) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, f"process {i} exited with {p.returncode}:\n{text[-4000:]}"


def start_process(process_id: int, num_processes: int, port: int, local_devices: int = 2) -> None:
    """This process's ``local_devices`` CPU devices joined to the job at ``port``."""
    os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={local_devices}"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax

    jax.config.update("jax_num_cpu_devices", local_devices)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{port}",
        num_processes=num_processes,
        process_id=process_id,
        initialization_timeout=60,
    )
