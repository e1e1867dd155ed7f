"""Run a benchmark's JAX part in a process of its own, on 8 CPU devices and without torch.

The torch and JAX halves of a side-by-side benchmark do not share an interpreter: each
framework keeps its own threads, and XLA's device count is fixed at its first import. The
JAX script takes its options as one JSON argument and prints its result as the last line of
its output, one JSON value.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any


def run_jax_part(script: str, options: dict[str, Any], *, timeout_s: float = 3600.0) -> Any:
    """Run ``benchmarks/<script>`` with ``options`` on 8 CPU devices; the JSON it printed last.

    Raises:
        SystemExit: the script failed (the end of its error output quoted).
    """
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    done = subprocess.run(
        [sys.executable, path, json.dumps(options)],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the JAX part failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
