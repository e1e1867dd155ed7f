"""Every link between the docs resolves, and every design section the tree cites exists.

The design of record is split by subject into docs/design-*.md; docs/design.md is the index
that maps each stable section number to its page. These tests fail when

- a relative link in README.md or docs/*.md names a file that does not exist, or a heading
  (``page.md#anchor``, GitHub's anchor rule) that the page does not have;
- code, tests, docs or the README cite ``docs/design.md §N`` (or ``design §N``) for an N
  the index does not list, or a design page mentions a bare ``§N`` the index does not list;
- a design page has a numbered section (``## N. Title``) that the index lacks or files under
  another page, or two pages number a section alike.
"""

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
INDEX = ROOT / "docs" / "design.md"
DESIGN_PAGES = sorted((ROOT / "docs").glob("design-*.md"))
# Where the tree cites the design: source, tests, docs, scripts and the build files.
SOURCES = ("gradsync_core", "gradsync_torch", "gradsync_jax", "tests", "benchmarks", "examples")
CITING = [
    *(p for d in (*SOURCES, "docs") for p in sorted((ROOT / d).rglob("*.py"))),
    *DOCS,
    ROOT / "pyproject.toml",
    ROOT / ".ci" / "run",
]


def _gen_api():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ANCHOR = _gen_api()._anchor
LINK = re.compile(r"\]\(([^)\s]+)\)")
# "docs/design.md §9", "design.md](design.md) §11", "design §6", "design.md\n# §9", then any
# further numbers of the same citation: "§5, §6", "§2-§5", "§3, §7, §8".
CITE = re.compile(
    r"\bdesign(?:\.md)?(?:\]\([^)]*\))?[\s,(#*]*§\s?(\d+)((?:\s*(?:,|-|–|and)\s*§?\s?\d+\b)*)"
)
BARE = re.compile(r"§(\d+)\b(?!\.\d)")  # §5.3 is a paper's section, not the design's


def _prose(text: str) -> str:
    """The text outside fenced code blocks and inline code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: pathlib.Path) -> set[str]:
    """The heading anchors GitHub gives a page (a repeated heading gets -1, -2, ...)."""
    out: set[str] = set()
    seen: dict[str, int] = {}
    fenced = False
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            anchor = ANCHOR(m.group(1))
            n = seen.get(anchor, 0)
            seen[anchor] = n + 1
            out.add(anchor if n == 0 else f"{anchor}-{n}")
    return out


def _index() -> dict[int, tuple[str, str]]:
    """Section number -> (page, anchor), from the index table of docs/design.md."""
    rows = re.findall(r"^\| §(\d+) \| \[[^\]]+\]\(([\w.-]+)#([\w-]+)\)", INDEX.read_text(), re.M)
    index: dict[int, tuple[str, str]] = {}
    for number, page, anchor in rows:
        assert int(number) not in index, f"docs/design.md lists §{number} twice"
        index[int(number)] = (page, anchor)
    return index


def _links():
    for doc in DOCS:
        for target in sorted(set(LINK.findall(_prose(doc.read_text())))):
            if not re.match(r"[a-z]+:", target):  # https:, mailto: are not checked here
                yield pytest.param(doc, target, id=f"{doc.name}:{target}")


@pytest.mark.parametrize(("doc", "target"), list(_links()))
def test_every_relative_link_resolves(doc, target):
    path, _, anchor = target.partition("#")
    page = (doc.parent / path).resolve() if path else doc
    assert page.exists(), f"{doc.name} links to {path}, which does not exist"
    if anchor and page.suffix == ".md":
        assert anchor in _anchors(page), f"{doc.name} links to {target}: no such heading"


def test_every_cited_design_section_is_in_the_index():
    index = _index()
    missing = []
    for path in CITING:
        text = path.read_text()
        for m in CITE.finditer(text):
            for number in [m.group(1), *re.findall(r"\d+", m.group(2))]:
                if int(number) not in index:
                    line = text[: m.start()].count("\n") + 1
                    missing.append(f"{path.relative_to(ROOT)}:{line}: {m.group(0)!r}")
    for page in DESIGN_PAGES:
        for number in BARE.findall(_prose(page.read_text())):
            if int(number) not in index:
                missing.append(f"{page.name}: §{number}")
    assert index, "docs/design.md has no index table"
    assert not missing, f"cited design sections not in docs/design.md's index: {missing}"


def test_the_index_lists_every_numbered_section_of_the_design_pages():
    index = _index()
    found = {}
    for page in DESIGN_PAGES:
        for number, title in re.findall(r"^## (\d+)\. (.+)$", page.read_text(), re.M):
            assert int(number) not in found, f"§{number} is in {found.get(int(number))} and {page}"
            found[int(number)] = (page.name, ANCHOR(f"{number}. {title}"))
    assert found == index, "docs/design.md's index differs from the pages' numbered sections"
    assert sorted(found) == list(range(1, len(found) + 1)), "the section numbers have a gap"
