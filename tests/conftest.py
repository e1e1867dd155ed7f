"""Test-wide settings that must happen before any JAX operation (docs/design.md §10)."""

import os
import warnings

import pytest

# 8 fake CPU devices for the JAX suites; harmless for the others.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

try:
    import jax
except ImportError:  # the core suite runs without JAX
    jax = None
else:
    jax.config.update("jax_num_cpu_devices", 8)


# The README's test command runs the files on two pytest-xdist workers (pyproject's addopts:
# `-n 2 --dist loadfile --no-loadscope-reorder`), which take whole files in collection order
# (without --no-loadscope-reorder, xdist orders them by number of tests and ignores this).
# A long file that starts last runs alone at the end, so the longest files go first:
# longest-first scheduling. Measured serially (`-n 0`, junit per-test times summed per file)
# on the shared 2-core machine under load (1-minute load average 2.7-16, median 9), so the
# seconds are 2-4x a quiet machine's; every file of 17 s or more there. test_zero3_sweep.py
# (it failed on that tree) and test_cross_pipeline.py (newer) were not timed with them. The
# fast lane (`-m "not slow"`) keeps this order for what is left of each file.
LONGEST_FIRST = (
    "tests/jax/test_pipeline.py",  # 249 s (newer: timed alone at load 3-8)
    "tests/examples/test_examples.py",  # 240 s
    "tests/jax/test_param_sharding.py",  # 210 s
    "tests/jax/test_nd_parallel.py",  # 190 s (newer: timed alone at load 3-6)
    "tests/test_readme.py",  # 182 s
    "tests/parity/test_cross_pipeline.py",  # 2.5 min at load 10 (59 s of CPU), not timed here
    "tests/jax/test_pipeline_zero3.py",  # 150 s at load 6 (40 s of it the fast lane)
    "tests/jax/test_zero_coupled.py",  # 98 s
    "tests/jax/test_zero_sweep.py",  # 97 s
    "tests/jax/test_zero.py",  # 92 s
    "tests/parity/test_cross_checkpoint.py",  # 85 s
    "tests/jax/test_step.py",  # 71 s
    "tests/faults/test_async_torch_faults.py",  # 86 s, the soak 51 s of it (load 6-8)
    "tests/jax/test_checkpoint_multiprocess.py",  # 58 s
    "tests/jax/test_nd_checkpoint.py",  # 54 s (fifth sitting, -n 0 at load 3)
    "tests/jax/test_shared_reductions_step.py",  # 55 s
    "tests/jax/test_pipeline_flax.py",  # 52 s (newer: timed alone at load 3-8)
    "tests/jax/test_zero3_clip.py",  # 50 s
    "tests/jax/test_zero3_sweep.py",
    "tests/jax/test_step_multiprocess.py",  # 43 s
    "tests/torch/test_nd_checkpoint.py",  # 75 s (load 2-8), 42 s of it one spawn of 8 ranks
    "tests/torch/test_matrix_optimizer.py",  # 31 s (newer: timed alone at load 7)
    "tests/torch/test_zero.py",  # 35 s
    "tests/parity/test_cross_tied.py",  # 33 s
    "tests/torch/test_fully_shard.py",  # 32 s
    "tests/parity/test_cross_param_shards.py",  # 30 s
    "tests/faults/test_extra_sync.py",  # 29 s
    "tests/torch/test_pipeline.py",  # 26 s
    "tests/jax/test_sync.py",  # 25 s
    "tests/jax/test_zero_checkpoint.py",  # 24 s
    "tests/torch/test_fully_shard_compile.py",  # 24 s
    "tests/core/test_cli.py",  # 24 s
    "tests/torch/test_data_parallel.py",  # 24 s
    "tests/jax/test_model_parallel.py",  # 23 s
    "tests/jax/test_zero_flax.py",  # 20 s
    "tests/core/test_megatron_groups.py",  # 19 s (megatron-core's import)
    "tests/jax/test_param_sharding_zero_gradient.py",  # 19 s
    "tests/parity/test_data_position.py",  # 18 s
    "tests/jax/test_moe.py",  # 18 s
    "tests/torch/test_fully_shard_checkpoint.py",  # 18 s
    "tests/parity/test_torch_jax_parity.py",  # 17 s
)


def pytest_collection_modifyitems(session, config, items):
    """Order the long files first (a stable sort: within a file, and among the rest, the
    collection order stays)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(LONGEST_FIRST)))


class _Deprecations:
    """``messages``: the ``DeprecationWarning``s raised so far in the test, in order."""

    def __init__(self, caught: list) -> None:
        self.caught = caught

    @property
    def messages(self) -> list[str]:
        return [str(w.message) for w in self.caught if issubclass(w.category, DeprecationWarning)]


@pytest.fixture
def deprecations():
    """The deprecation warnings a test raises, every old spelling warning again (gradsync
    warns once per process per old name: the registry of those that warned is cleared around
    the test)."""
    from gradsync_core import deprecation

    deprecation._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield _Deprecations(caught)
    deprecation._warned.clear()
