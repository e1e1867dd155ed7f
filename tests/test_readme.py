"""The README's self-contained Python examples run as printed (each in a fresh interpreter)."""

import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
# Blocks that run on their own: they import what they use and need no torchrun.
RUNNABLE = [b for b in BLOCKS if b.lstrip().startswith(("from gradsync_core", "import os"))]


def test_the_readme_has_runnable_examples():
    assert len(RUNNABLE) >= 2


@pytest.mark.parametrize("block", RUNNABLE, ids=lambda b: b.split("\n")[0][:40])
def test_readme_example_runs(block):
    out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
