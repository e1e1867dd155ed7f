"""The examples use gradsync's public names only, so a user can copy them (issue 37).

The public surface is what docs/api.md documents: the ``__all__`` of each module in
docs/gen_api.py's ``PACKAGES`` (``gradsync_core``, ``gradsync_core.checkpoint``,
``gradsync_torch``, ``gradsync_jax``). An example may import a public module, import a name
from one, or read a name off one; anything else (a module or name starting with ``_``, a
subpackage such as ``gradsync_torch.agreement`` whose layout may move between releases, a
name missing from ``__all__``) is reported with its file and line. The surface is read from
the packages' source with ``ast``: no framework is imported.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "examples").rglob("*.py"))


def _public_modules() -> tuple[str, ...]:
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return tuple(module.PACKAGES)


def _exported(module: str) -> frozenset[str]:
    """``module.__all__``, read from its ``__init__.py`` (a literal list)."""
    source = ROOT.joinpath(*module.split("."), "__init__.py")
    for node in ast.parse(source.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return frozenset(ast.literal_eval(node.value))  # type: ignore[arg-type]
    raise AssertionError(f"{source} has no literal __all__")


SURFACE = {module: _exported(module) for module in _public_modules()}


def _name_ok(module: str, name: str) -> bool:
    return f"{module}.{name}" in SURFACE or name in SURFACE.get(module, frozenset())


def private_uses(source: str) -> list[str]:
    """Each use of a gradsync name outside the public surface in ``source``, as
    ``"line N: what"``."""
    found: list[str] = []
    modules: dict[str, str] = {}  # a local name -> the gradsync module it is bound to

    def bad(node: ast.AST, what: str) -> None:
        found.append(f"line {node.lineno}: {what}")  # type: ignore[attr-defined]

    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if not alias.name.startswith("gradsync"):
                    continue
                if alias.name not in SURFACE:
                    bad(node, f"import {alias.name} (not a public module: {sorted(SURFACE)})")
                modules[alias.asname or alias.name.split(".")[0]] = (
                    alias.name if alias.asname else alias.name.split(".")[0]
                )
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("gradsync"):
            module = node.module or ""
            if module not in SURFACE:
                names = ", ".join(a.name for a in node.names)
                bad(node, f"from {module} import {names} (import them from a public module)")
                continue
            for alias in node.names:
                if not _name_ok(module, alias.name):
                    bad(node, f"from {module} import {alias.name} (not in {module}.__all__)")
                elif f"{module}.{alias.name}" in SURFACE:
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            module = modules.get(node.value.id)
            if module is not None and not _name_ok(module, node.attr):
                bad(node, f"{module}.{node.attr} (not in {module}.__all__)")
    return sorted(set(found), key=lambda line: int(line.split()[1].rstrip(":")))


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_an_example_imports_only_public_gradsync_names(path: Path) -> None:
    uses = private_uses(path.read_text())
    assert not uses, f"{path.relative_to(ROOT)} uses private gradsync names: " + "; ".join(uses)


@pytest.mark.parametrize(
    ("source", "reported"),
    [
        ("from gradsync_torch._specs import sharded_over", "from gradsync_torch._specs"),
        ("from gradsync_torch.agreement import agree_on", "from gradsync_torch.agreement"),
        ("from gradsync_jax.pipeline.loop import run_pipeline", "import them from a public"),
        ("from gradsync_jax import _axes", "not in gradsync_jax.__all__"),
        ("from gradsync_torch import sharded_over", "not in gradsync_torch.__all__"),
        ("import gradsync_jax.zero.clip", "not a public module"),
        ("import gradsync_jax as gj\ngj.varying\ngj._axes.varying", "gradsync_jax._axes"),
        ("from gradsync_core import checkpoint\ncheckpoint.nope", "gradsync_core.checkpoint.nope"),
    ],
)
def test_the_check_reports_each_way_of_reaching_a_private_name(source: str, reported: str) -> None:
    uses = private_uses(source)
    assert len(uses) == 1 and reported in uses[0], uses


def test_the_check_passes_public_names() -> None:
    source = (
        "import gradsync_jax\nfrom gradsync_core import Topology, checkpoint\n"
        "from gradsync_core.checkpoint import layout_record\n"
        "from gradsync_torch import agree_on, save_boxes\n"
        "gradsync_jax.varying\ncheckpoint.layout_record\n"
    )
    assert private_uses(source) == []
