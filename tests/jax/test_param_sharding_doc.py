"""docs/jax-zero3.md's Python examples run as printed (each in a fresh interpreter)."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "jax-zero3.md").read_text(), re.S)


def test_the_doc_has_two_examples() -> None:
    assert len(BLOCKS) == 2


@pytest.mark.parametrize("block", BLOCKS, ids=["linen", "nnx"])
def test_doc_example_runs(block: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)  # the example sets its own device count
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=300, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
