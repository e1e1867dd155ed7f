"""``gradsync checkpoint export/import`` without the framework they need: one sentence, exit 2
(the conversions themselves: tests/torch/test_dcp_interchange.py,
tests/jax/test_orbax_interchange.py)."""

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    for name in ("torch", "jax", "orbax"):
        sys.modules[name] = None  # every import of them fails, importlib's too
    from gradsync_core.cli._main import main
    assert main(["checkpoint", "export", "--to", "dcp", "a", "b", "--model", "m:f"]) == 2
    assert main(["checkpoint", "import", "--from", "orbax", "a", "b", "--model", "m:f"]) == 2
    """
)


def test_a_missing_framework_is_one_sentence():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    lines = out.stderr.splitlines()
    assert len(lines) == 2, out.stderr
    assert lines[0].startswith("gradsync: error: dcp interchange needs torch, and importing")
    assert lines[0].endswith('install it with pip install "gradsync[torch]"')
    assert lines[1].startswith("gradsync: error: orbax interchange needs JAX and orbax-checkpoint")
    assert lines[1].endswith('pip install "gradsync[orbax]"')
