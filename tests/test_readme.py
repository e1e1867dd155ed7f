"""Every code block in README.md and docs/*.md runs as printed, or says why it does not.

A fenced block is ```python, ```bash, ```text (output, trees and formulas: not code) or
```diff (a change to show: not code). An
HTML comment on the line before the fence changes how it runs:

- ``<!-- doctest: torchrun N -->``: a torchrun script, run on N gloo ranks
  (``python -m torch.distributed.run --standalone --nproc_per_node N``);
- ``<!-- doctest: continues -->``: runs after the blocks before it in the same file, in one
  interpreter, as the reader would paste them (like doctest's per-file namespace);
- ``<!-- doctest: skip: REASON -->``: not run; the reason must say why (GPU only, an excerpt
  of an example or test that the suite runs, ...).

Unmarked Python blocks run in a fresh interpreter in an empty directory, with 8 CPU devices
for JAX and the environment torchrun gives rank 0 of 1, so a torchrun script runs as one
rank; unmarked bash blocks run under ``bash -euo pipefail`` in an empty directory.

A block that starts a torch process group ends the way the README's "Ending a torch run"
says (its holders in functions, then ``dist.barrier(); dist.destroy_process_group();
gc.collect()``), checked in the code of every block; a block whose process aborts as it ends
(``terminate called ...``, SIGABRT: a gloo group outlived the script) fails with that sentence.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from tests.support.ports import free_port

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = ("python", "bash", "text", "diff")
NOT_CODE = ("text", "diff")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```\n", re.S | re.M)
MARKER = re.compile(r"<!-- doctest: (torchrun \d+|continues|skip: .+?) -->\s*$")


@dataclasses.dataclass
class Block:
    doc: str
    line: int
    lang: str
    code: str
    marker: str | None

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def _blocks(path: pathlib.Path) -> list[Block]:
    text = path.read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text[: m.start()].count("\n") + 1
        name = str(path.relative_to(ROOT))
        out.append(Block(name, line, m.group(1), m.group(2), marker and marker.group(1)))
    return out


BLOCKS = [b for doc in DOCS for b in _blocks(doc)]


def _runs() -> list[list[Block]]:
    """Runnable groups: a block followed by the blocks marked ``continues``."""
    groups: list[list[Block]] = []
    for b in BLOCKS:
        if b.lang in NOT_CODE or (b.marker or "").startswith("skip"):
            continue
        if b.marker == "continues":
            assert groups and groups[-1][0].doc == b.doc, f"{b.id}: nothing to continue"
            groups[-1].append(b)
        else:
            groups.append([b])
    return groups


RUNS = _runs()


def test_every_block_is_tagged_and_every_skip_gives_a_reason():
    for b in BLOCKS:
        assert b.lang in LANGUAGES, f"{b.id}: tag the fence as one of {LANGUAGES}"
        if (b.marker or "").startswith("skip"):
            reason = b.marker.split(":", 1)[1].strip()
            assert len(reason.split()) >= 3, f"{b.id}: say why the block is skipped"
        if b.marker and b.marker.startswith("torchrun"):
            assert b.lang == "python", b.id


def test_the_first_screen_has_a_torch_and_a_flax_example_that_run():
    readme = [g[0] for g in RUNS if g[0].doc == "README.md" and g[0].lang == "python"]
    assert readme[0].marker == "torchrun 2" and "gradsync_torch" in readme[0].code
    assert "destroy_process_group" in readme[0].code  # ends a process group cleanly
    assert "gradsync_jax" in readme[1].code and "flax" in readme[1].code
    assert all(len(b.code.splitlines()) <= 22 for b in readme[:2])


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env["PATH"]])
    env.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1")
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return env


# README, "Ending a torch run": gloo stops a process group's threads only when its last
# reference is dropped; one still alive as the interpreter exits is killed in C++ and the
# process aborts (`terminate called without an active exception`, SIGABRT) after a run that
# succeeded, more often on a loaded machine (docs/torch-data-parallel.md, "Ending a run
# cleanly", counts the aborts of each ending).
ENDING = "dist.barrier(); dist.destroy_process_group(); gc.collect()"
ENDING_RULE = (
    "Keep what holds a process group (the wrapper, the optimizer, ProcessGroups, a sharded "
    f"model) inside a function, call it, and end with `{ENDING}` (README, 'Ending a torch run')."
)
ABORTS = ("terminate called", "SIGABRT")


def _aborted_at_exit(out: subprocess.CompletedProcess) -> str | None:
    """What says the process (or a torchrun rank) aborted, as gloo's threads do at exit, or
    None."""
    if out.returncode == -signal.SIGABRT:
        return "killed by SIGABRT"
    return next((f"`{sign}`" for sign in ABORTS if sign in out.stderr), None)


def _ending_problem(code: str) -> str | None:
    """Why a block that starts a process group does not end it as the README says, or None.

    After ``init_process_group`` the module level may only call the block's own functions
    (binding what they return), then run the README's ending: a name bound to a wrapper or an
    optimizer at module level would hold the group past its destruction.
    """
    tree = ast.parse(code)
    body = tree.body
    start = next(
        (i for i, node in enumerate(body) if "init_process_group" in ast.unparse(node)), None
    )
    if start is None:
        return None
    if not any(line.split("#")[0].strip() == ENDING for line in code.splitlines()):
        return f"it does not end with `{ENDING}`"
    functions = {node.name for node in body if isinstance(node, ast.FunctionDef)}
    after = body[start + 1 :]
    for node, following in zip(after, [*after[1:], None], strict=True):
        text = ast.unparse(node)
        ending = text == "dist.barrier()" and "destroy" in ast.unparse(following or ast.Pass())
        if ending or "destroy_process_group" in text:
            return None
        call = node.value if isinstance(node, ast.Expr | ast.Assign) else None
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name)) or (
            call.func.id not in functions
        ):
            return f"`{text.splitlines()[0]}` runs at module level while the group is alive"
    return "it never destroys the process group"


def test_every_torch_block_ends_the_way_the_readme_says():
    """A block that starts a process group keeps its holders in functions and ends with the
    README's line, so no doc block can abort at exit under load (``test_doc_block_runs``
    catches an abort when one happens; this catches the cause in every block, abort or not)."""
    problems = [
        f"{group[0].id}: {problem}"
        for group in RUNS
        if group[0].lang == "python"
        and (problem := _ending_problem("\n".join(b.code for b in group))) is not None
    ]
    assert not problems, "\n".join([*problems, ENDING_RULE])


def test_an_abort_at_exit_is_recognised():
    """What the runner reads as an unclean end: a process killed by SIGABRT, and the line
    gloo's threads print (torchrun keeps a rank's stderr, and exits 1 for it)."""
    aborted = subprocess.run([sys.executable, "-c", "import os; os.abort()"], capture_output=True)
    assert _aborted_at_exit(aborted) == "killed by SIGABRT"
    rank = subprocess.CompletedProcess([], 1, "", "terminate called without an active exception")
    assert _aborted_at_exit(rank) == "`terminate called`"
    clean = subprocess.run([sys.executable, "-c", "pass"], capture_output=True, text=True)
    assert _aborted_at_exit(clean) is None


# A fresh interpreter that imports torch or JAX costs 5-17 s on the loaded 2-core machine (the
# Flax and torchrun blocks most): those blocks are `slow`, outside the development loop
# (`-m "not slow"`); the rest, and the checks of every block's code above, stay in it.
FRAMEWORK = re.compile(
    r"^\s*(?:import|from)\s+(?:torch|jax|flax|optax|gradsync_torch|gradsync_jax)\b", re.M
)


def _param(group: list[Block]) -> object:
    slow = FRAMEWORK.search("\n".join(b.code for b in group))
    return pytest.param(group, id=group[0].id, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("group", [_param(g) for g in RUNS])
def test_doc_block_runs(group, tmp_path):
    head = group[0]
    code = "\n".join(b.code for b in group)
    if head.lang == "bash":
        cmd = ["bash", "-euo", "pipefail", "-c", code]
    elif head.marker and head.marker.startswith("torchrun"):
        script = tmp_path / "train.py"
        script.write_text(code)
        n = head.marker.split()[1]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        cmd += [f"--nproc_per_node={n}", str(script)]
    else:
        cmd = [sys.executable, "-c", code]
    env = _env()
    if head.marker and head.marker.startswith("torchrun"):
        for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT"):
            del env[key]  # torchrun sets them per rank
    out = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert not _aborted_at_exit(out), (
        f"{head.id}: a process aborted as it ended ({_aborted_at_exit(out)}): a gloo process "
        f"group outlived the script. {ENDING_RULE}\n{out.stderr[-2000:]}"
    )
    assert out.returncode == 0, f"{head.id}:\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}"


def _anchor_rule():
    """docs/gen_api.py's heading-anchor rule, so links it writes and links checked agree."""
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._anchor


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (fenced code skipped)."""
    anchor, out, fenced = _anchor_rule(), set(), False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.*)", line)):
            out.add(anchor(m.group(1)))
    return out


LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_relative_link_resolves(doc):
    """A link to another page (and to a section of it) lands somewhere: renamed headings and
    moved pages are caught here."""
    prose = FENCE.sub("", doc.read_text())  # code may contain "](" (``layers[0](x)``)
    for target in LINK.findall(prose):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        page = (doc.parent / path).resolve() if path else doc
        assert page.exists(), f"{doc.name} links to {target}: no such file"
        if anchor and page.suffix == ".md":
            assert anchor in _anchors(page), f"{doc.name} links to {target}: no such section"
