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
# A long file that starts last runs alone at the end, so the longest files (measured serially
# with `--durations=0`, 2 cores: 20-60 s each) go first: longest-first scheduling. The last
# five were measured in the suite instead (`-n 2`, loaded machine, torch ranks from the fork
# server: 18-26 s each).
LONGEST_FIRST = (
    "tests/parity/test_cross_pipeline.py",  # 10 tests, 59 s of CPU (2.5 min at load 10)
    "tests/jax/test_zero_sweep.py",
    "tests/examples/test_examples.py",
    "tests/test_readme.py",
    "tests/parity/test_cross_checkpoint.py",
    "tests/jax/test_zero.py",
    "tests/jax/test_zero_coupled.py",
    "tests/jax/test_zero3_clip.py",
    "tests/jax/test_zero3_sweep.py",
    "tests/torch/test_fully_shard.py",
    "tests/torch/test_zero.py",
    "tests/torch/test_agreement.py",
    "tests/faults/test_torch_save_faults.py",
    "tests/torch/test_data_parallel.py",
    "tests/jax/test_shared_reductions_step.py",
    "tests/jax/test_param_sharding.py",
    "tests/jax/test_step.py",
    "tests/torch/test_param_shard_plan_fsdp.py",
    "tests/jax/test_checkpoint_multiprocess.py",
    "tests/torch/test_fully_shard_compile.py",
    "tests/jax/test_zero_checkpoint.py",
    "tests/parity/test_cross_tied.py",
    "tests/jax/test_step_multiprocess.py",
    "tests/torch/test_fully_shard_checkpoint.py",
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
