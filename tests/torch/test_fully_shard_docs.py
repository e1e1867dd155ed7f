"""docs/torch-zero3.md's Python blocks run as printed, each in a fresh interpreter."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "torch-zero3.md"
BLOCKS = re.findall(r"```python\n(.*?)```", DOC.read_text(), re.S)


def test_the_doc_has_a_runnable_example():
    assert BLOCKS


@pytest.mark.parametrize("block", BLOCKS, ids=lambda b: b.split("\n")[0][:40])
def test_doc_example_runs(block):
    root = DOC.parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    out = subprocess.run(
        [sys.executable, "-c", block], capture_output=True, text=True, timeout=180, env=env
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Shard(dim=0)" in out.stdout, out.stdout
