"""Test-wide settings that must happen before any JAX operation (docs/design.md §10)."""

import os

# 8 fake CPU devices for the JAX suites; harmless for the others.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
    import jax
except ImportError:  # the core suite runs without JAX
    jax = None
else:
    jax.config.update("jax_num_cpu_devices", 8)
