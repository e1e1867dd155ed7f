"""The packages' layers, read from their import statements (docs/design.md §1, §14).

No module of gradsync_core, gradsync_torch or gradsync_jax imports itself back, and no
subpackage imports another that imports it back; the core's layers stand in order (plan, then
checkpoint, then the command line), the core names no executor, and the executors import only
the core's public modules.

A cycle hidden behind a function-level import still couples the modules, so every ``import``
statement counts, wherever it stands. The graph is built from the source text alone: nothing
is imported, so the test needs neither torch nor JAX.
"""

from __future__ import annotations

import ast
import itertools
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("gradsync_core", "gradsync_torch", "gradsync_jax")


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports, at any depth of its source."""
    package = name if is_package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # ``from pkg import mod`` imports the module; ``from pkg import name``, the package.
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        else:
            continue
        found.update(t for t in targets if t in known and t != name)
    return found


def import_graph() -> dict[str, set[str]]:
    paths = [p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))]
    known = {module_name(p) for p in paths}
    return {
        module_name(p): imported_modules(
            p.read_text(), module_name(p), p.name == "__init__.py", known
        )
        for p in paths
    }


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as a list of modules (first == last), or None. Iterative depth-first search."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    for start in sorted(graph):
        if state.get(start):
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            elif not state.get(nxt):
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_the_packages_have_no_import_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 40  # the walk found the packages
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])


def subpackage(module: str) -> str:
    """``gradsync_torch.zero.flat`` -> ``gradsync_torch.zero``; a top-level module is itself."""
    parts = module.split(".")
    package = ROOT.joinpath(*parts[:2])
    return ".".join(parts[:2]) if len(parts) > 1 and package.is_dir() else module


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The import graph between the subpackages of each top-level package (modules at a
    package's top level stand for themselves)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        mine = subpackage(module)
        edges = packages.setdefault(mine, set())
        edges.update(t for t in map(subpackage, targets) if t != mine and "." in t)
    return packages


def test_the_subpackages_have_no_import_cycle() -> None:
    graph = package_graph(import_graph())
    assert {"gradsync_torch.zero", "gradsync_torch.checkpoint", "gradsync_core.plan"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "package cycle: " + " -> ".join(cycle or [])


# The core's layers, lowest first: each imports only the ones before it.
CORE_LAYERS = ("gradsync_core.plan", "gradsync_core.checkpoint", "gradsync_core.cli")


def test_the_core_layers_stand_in_order() -> None:
    graph = package_graph(import_graph())
    for i, layer in enumerate(CORE_LAYERS):
        above = set(CORE_LAYERS[i + 1 :])
        assert not graph[layer] & above, f"{layer} imports {sorted(graph[layer] & above)}"


def _names(source: str) -> list[tuple[int, str]]:
    """Every module an import names (absolute imports) and every string that is a dotted
    module path, with its line."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            module = node.module or ""
            found += [(node.lineno, module)]
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:\w+)?", node.value):
                found.append((node.lineno, node.value))
    return found


def test_the_core_names_no_executor() -> None:
    """Not in an import, not as a module path held as data (the command line finds the
    executors through their entry points)."""
    for path in sorted((ROOT / "gradsync_core").rglob("*.py")):
        for line, name in _names(path.read_text()):
            assert not re.match(r"gradsync_(torch|jax)\b", name), (
                f"{path.relative_to(ROOT)}:{line} names {name}"
            )


def test_the_executors_import_only_the_public_core() -> None:
    for package in ("gradsync_torch", "gradsync_jax"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for line, name in _names(path.read_text()):
                parts = name.split(".")
                private = [p for p in parts[1:] if p.startswith("_") and p != "__init__"]
                assert parts[0] != "gradsync_core" or not private, (
                    f"{path.relative_to(ROOT)}:{line} imports the private {name}"
                )


# Executors whose data_parallel package is already the base layer (docs/design.md §14);
# gradsync_torch joins once its ProcessGroups leave model_parallel/.
LAYERED = ("gradsync_torch", "gradsync_jax")


@pytest.mark.parametrize("package", LAYERED)
def test_data_parallel_never_imports_model_parallel(package: str) -> None:
    """The base layer does not depend on the specialised one: the shared-parameter sums and
    the meshes sit above both."""
    graph = import_graph()
    base, special = f"{package}.data_parallel", f"{package}.model_parallel"
    modules = [m for m in graph if m == base or m.startswith(base + ".")]
    assert modules, f"{base} has no modules"
    for module in modules:
        wrong = sorted(t for t in graph[module] if t == special or t.startswith(special + "."))
        assert not wrong, f"{module} imports {wrong}"


@pytest.mark.parametrize(
    ("graph", "has_cycle"),
    [
        ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
        ({"a": {"b"}, "b": {"a"}}, True),
        ({"a": {"b", "c"}, "b": {"c"}, "c": {"d"}, "d": {"b"}}, True),
        ({"a": set()}, False),
    ],
    ids=["chain", "two", "three-deep", "alone"],
)
def test_find_cycle(graph: dict[str, set[str]], has_cycle: bool) -> None:
    cycle = find_cycle(graph)
    assert (cycle is not None) == has_cycle
    if cycle:
        assert cycle[0] == cycle[-1]
        assert all(b in graph[a] for a, b in itertools.pairwise(cycle))


def test_function_level_and_relative_imports_count() -> None:
    known = {"pkg", "pkg.a", "pkg.b", "pkg.sub", "pkg.sub.c"}
    source = "def f():\n    from pkg import b\n\nfrom ..a import x\nfrom . import c, y\n"
    found = imported_modules(source, "pkg.sub.d", False, known)
    assert found == {"pkg.b", "pkg.a", "pkg.sub.c", "pkg.sub"}
