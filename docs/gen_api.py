"""Write docs/api.md from each package's ``__all__``: ``python docs/gen_api.py``.

One entry per exported name: its signature, the first line of its docstring and a link to the
first guide section that names it in backticks. ``--check`` exits 1 when docs/api.md differs
from what this script would write (tests/test_api_doc.py runs the same comparison), so the
reference cannot drift from the code: regenerate and commit it with the change.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Iterator

ROOT = pathlib.Path(__file__).resolve().parent.parent
API_MD = ROOT / "docs" / "api.md"

# The public API: each package's top level, plus the executors' view of the checkpoint format.
# Subpackages (gradsync_torch.zero, gradsync_jax.data_parallel, ...) are importable but are
# not the API: what they export beyond these lists may move between releases (design §14).
PACKAGES = {
    "gradsync_core": "the planner (standard library only)",
    "gradsync_core.checkpoint": "the checkpoint format and save protocol, for executors",
    "gradsync_torch": "the executor on torch.distributed",
    "gradsync_jax": "the executor on JAX collectives and sharded Optax",
}

# Where a package's names are explained, searched in this order (the design pages last: they
# are the reference of record, the guides are where a user starts).
GUIDES = {
    "gradsync_core": [
        "cli.md",
        "data-position.md",
        "checkpoints.md",
        "model-parallel.md",
        "pipeline.md",
        "matrix-optimizers.md",
        "cost-model.md",
    ],
    "gradsync_core.checkpoint": ["checkpoints.md"],
    "gradsync_torch": [
        "torch-data-parallel.md",
        "torch-zero.md",
        "model-parallel.md",
        "checkpoints.md",
        "data-position.md",
        "interchange.md",
        "pipeline.md",
        "torch-zero3.md",
        "matrix-optimizers.md",
        "cost-model.md",
    ],
    "gradsync_jax": [
        "jax.md",
        "jax-zero.md",
        "model-parallel.md",
        "pipeline.md",
        "checkpoints.md",
        "data-position.md",
        "interchange.md",
        "jax-zero3.md",
        "matrix-optimizers.md",
        "cost-model.md",
    ],
}
COMMON_TAIL = [
    "design-semantics.md",
    "design-checkpoints.md",
    "design-environment.md",
    "design-names-and-layout.md",
    "design-faults.md",
    "design-zero3.md",
    "design-pipeline.md",
]
# A name no section mentions is linked to the section that covers its area.
FALLBACK = {
    "gradsync_core": "[design-semantics.md — 8. Plans are values]"
    "(design-semantics.md#8-plans-are-values)",
    "gradsync_core.checkpoint": "[design-checkpoints.md — 9. Checkpoints and interchange]"
    "(design-checkpoints.md#9-checkpoints-and-interchange)",
    "gradsync_torch": "[design-names-and-layout.md — 13. Names across the two executors]"
    "(design-names-and-layout.md#13-names-across-the-two-executors)",
    "gradsync_jax": "[design-names-and-layout.md — 13. Names across the two executors]"
    "(design-names-and-layout.md#13-names-across-the-two-executors)",
}


def _anchor(heading: str) -> str:
    """GitHub's heading anchor: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _sections(doc: str) -> Iterator[tuple[str, str]]:
    """(heading, body) per section of a markdown file, skipping fenced code."""
    heading, body, fenced = "", [], False
    for line in (ROOT / "docs" / doc).read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not fenced and re.match(r"#{1,4} ", line):
            yield heading, "\n".join(body)
            heading, body = line.lstrip("#").strip(), []
        else:
            body.append(line)
    yield heading, "\n".join(body)


def _link(package: str, name: str) -> str:
    """The section that explains ``name``: one whose heading names it, else the opening of a
    guide that names it (the guide is about it), else the first section that names it; guides
    first, the design pages last."""
    pattern = re.compile(r"`(?:[\w.]*\.)?" + re.escape(name) + r"(?:[(\[][^`]*)?`")
    docs = GUIDES[package] + COMMON_TAIL
    sections = [(doc, i, h, b) for doc in docs for i, (h, b) in enumerate(_sections(doc)) if h]
    passes = [
        lambda i, h, b: bool(pattern.search(h)),
        lambda i, h, b: i == 1 and bool(pattern.search(b)),  # section 0 precedes the title
        lambda i, h, b: bool(pattern.search(b)),
    ]
    for matches in passes:
        for doc, i, heading, body in sections:
            if matches(i, heading, body):
                return f"[{doc} — {heading}]({doc}#{_anchor(heading)})"
    return f"{FALLBACK[package]} (not named in a guide yet)"


def _signature(obj: object) -> str:
    try:
        sig = str(inspect.signature(obj))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return ""
    # Default values that print an address would change every run.
    return re.sub(r" at 0x[0-9a-f]+", "", sig)


def _first_line(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    if type(obj).__doc__ == doc:  # an int or str constant: its type's docstring says nothing
        return ""
    return doc.strip().split("\n\n")[0].replace("\n", " ")


def _entry(package: str, name: str, obj: object) -> str:
    if inspect.isclass(obj) or callable(obj):
        kind = "class" if inspect.isclass(obj) else "function"
        head = f"`{name}{_signature(obj)}`"
        summary = _first_line(obj) or "(no docstring)"
    else:
        kind = "constant"
        head = f"`{name} = {obj!r}`" if isinstance(obj, int | str | tuple) else f"`{name}`"
        summary = _first_line(obj)
        kind = "module" if inspect.ismodule(obj) else kind
    lines = [f"- **{kind}** {head}", summary, f"See {_link(package, name)}."]
    return "  \n  ".join(line for line in lines if line)


def render() -> str:
    """The full text of docs/api.md."""
    parts = [
        "# API reference",
        "",
        "Generated by `python docs/gen_api.py` from each package's `__all__`; do not edit by",
        "hand. `tests/test_api_doc.py` fails when this file differs from what the script writes,",
        "so a change to an exported name, signature or first docstring line comes with its",
        "regenerated reference. Only these names are the API; subpackages are importable but",
        "what they export beyond this list may move",
        "([design §14](design-names-and-layout.md#14-package-layout)).",
        "",
    ]
    for package, what in PACKAGES.items():
        module = importlib.import_module(package)
        parts += [f"## `{package}`: {what}", ""]
        for name in sorted(module.__all__, key=str.lower):
            parts.append(_entry(package, name, getattr(module, name)))
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str]) -> int:
    text = render()
    if "--check" in argv:
        if API_MD.read_text() != text:
            print("docs/api.md is stale: run `python docs/gen_api.py` and commit it")
            return 1
        return 0
    API_MD.write_text(text)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    raise SystemExit(main(sys.argv[1:]))
