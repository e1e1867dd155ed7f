"""gradsync_core imports and plans where neither torch nor JAX can be imported
(docs/design.md §1)."""

import subprocess
import sys
import textwrap

import gradsync_core

SCRIPT = textwrap.dedent(
    """
    import builtins, sys
    real_import = builtins.__import__
    BLOCKED = ("torch", "jax", "jaxlib", "flax", "optax", "numpy")

    def guarded(name, *args, **kwargs):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is blocked in this test")
        return real_import(name, *args, **kwargs)

    builtins.__import__ = guarded
    import gradsync_core as g
    from gradsync_core.cli._main import main
    specs = g.builtin_model("gpt2-small")
    buckets = g.plan_buckets(specs, pad_to=8)
    g.plan_greedy_shards(specs, world_size=8)
    g.plan_flat_shards(buckets, world_size=8)
    g.Topology.create(world_size=64, tp=2, cp=2).groups("dp-cp")
    assert main(["plan", "--json"]) == 0
    loaded = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
    assert not loaded, loaded
    print("planned without frameworks", file=sys.stderr)
    """
)


def test_core_plans_with_torch_and_jax_unavailable():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "planned without frameworks" in out.stderr


def test_core_sources_import_only_the_standard_library():
    import ast
    import pathlib

    root = pathlib.Path(gradsync_core.__file__).parent
    allowed = set(sys.stdlib_module_names) | {"gradsync_core", "__future__"}
    paths = sorted(root.rglob("*.py"))
    assert len(paths) > 30  # the walk reached the subpackages
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                mods = [node.module]
            else:
                continue
            for mod in mods:
                assert mod.split(".")[0] in allowed, f"{path.relative_to(root)} imports {mod}"
