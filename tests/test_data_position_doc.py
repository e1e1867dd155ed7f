"""docs/data-position.md's Python examples run as printed, each in a fresh interpreter (as
tests/test_readme.py runs the README's)."""

import pathlib
import re
import subprocess
import sys

import pytest

DOC = pathlib.Path(__file__).resolve().parent.parent / "docs" / "data-position.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_a_torch_and_a_jax_example():
    assert len(BLOCKS) == 2
    assert "gradsync_torch" in BLOCKS[0] and "gradsync_jax" in BLOCKS[1]


@pytest.mark.parametrize("block", BLOCKS, ids=["torch", "jax"])
def test_doc_example_runs(block):
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
