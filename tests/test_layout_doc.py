"""The package tree in docs/design-names-and-layout.md (§14) is generated, and cannot go stale.

docs/gen_layout.py writes one line per module from the first line of its docstring; these tests
fail when a module lacks a one-line summary, or when the committed page differs from what the
script writes now (a module added, removed, renamed or re-summarised without regenerating). The
hand-written tree it replaces had drifted: it omitted torch's ``param_sharding/``, four of
torch's ``checkpoint/`` modules, two of JAX's and five of the core's.
"""

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _gen_layout():
    spec = importlib.util.spec_from_file_location("gen_layout", ROOT / "docs" / "gen_layout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _gen_layout()
MODULES = sorted(p for package in GEN.PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(ROOT)) for p in MODULES])
def test_every_module_opens_with_a_one_line_summary(path):
    assert GEN.summary(path)  # ValueError names the module and the rule


def test_layout_section_is_what_the_generator_writes():
    assert GEN.LAYOUT_MD.read_text() == GEN.render(), (
        "docs/design-names-and-layout.md is stale: run python docs/gen_layout.py"
    )


def test_the_tree_lists_every_module_once():
    text = GEN.tree()
    for path in MODULES:
        name = f"`{path.parent.name}/`" if path.name == "__init__.py" else f"`{path.name}`"
        assert name in text, f"{path.relative_to(ROOT)} is missing from the generated tree"
    assert text.count("\n") - 3 == len(MODULES)  # the markers and blank lines aside


def test_a_summary_that_runs_on_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(GEN, "ROOT", tmp_path)
    module = tmp_path / "m.py"
    module.write_text('"""A summary that runs\non into the next line.\n"""\n')
    with pytest.raises(ValueError, match=r"m\.py: the docstring's first line .* one-line summary"):
        GEN.summary(module)
    module.write_text("x = 1\n")
    with pytest.raises(ValueError, match=r"m\.py has no module docstring"):
        GEN.summary(module)
