"""The test suite's own layout: helpers are shared through tests/support/ and problem modules,
never by importing another test module, and the scheduling list names files that exist."""

from __future__ import annotations

import ast
import pathlib

from tests.conftest import LONGEST_FIRST

ROOT = pathlib.Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


def _imported_modules(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, module) of every import in ``path``, ``from a import b`` giving ``a.b`` too."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def test_no_test_module_imports_another():
    """A helper two test files need lives in tests/support/ (or a problem module beside them):
    importing a test module runs its collection-time code and ties its private names to
    another file."""
    found = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in sorted(TESTS.rglob("*.py"))
        for line, module in _imported_modules(path)
        if module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")
    ]
    assert not found, "\n".join(found)


def test_the_longest_first_list_names_files_that_exist():
    missing = [name for name in LONGEST_FIRST if not (ROOT / name).is_file()]
    assert not missing, f"tests/conftest.py's LONGEST_FIRST names missing files: {missing}"
