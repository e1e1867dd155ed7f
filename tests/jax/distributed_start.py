"""Start one JAX process of a multi-process CPU job (``jax.distributed`` on 127.0.0.1).

Shared by the multi-process workers; it must run before anything else touches JAX.
"""

from __future__ import annotations

import os


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
