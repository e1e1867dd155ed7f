"""``gradsync plan --pp P --microbatches M --schedule NAME`` (docs/pipeline.md): the text, the
JSON, the refusals, and the charts docs/pipeline.md prints, run and compared."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from gradsync_core import PipelinePlan, Topology, builtin_model, plan_pipeline, simulate_pipeline
from gradsync_core.cli._main import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "pipeline.md"


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_text_has_stages_timeline_bubble_and_stash(capsys):
    code, out, _ = run(capsys, "--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert code == 0
    assert out.startswith("Pipeline 1F1B for gpt2-small: pp 4 x 1 stage per rank (loop")
    assert "Stages: layout 'Et*3|t*4|t*3|t*2L'" in out
    chart = [line for line in out.splitlines() if line.startswith("rank ")]
    assert chart[3].split()[2:8] == [".", ".", ".", "F0", "B0", "B0"]  # last rank: F0 at tick 3
    assert "Step 33 ticks; bubble 27.3% (idle / (ranks x step))" in out  # 3/11
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)$", out, re.M)
    assert rows == [("0", "9", "4"), ("1", "9", "3"), ("2", "9", "2"), ("3", "9", "1")]


def test_json_is_the_plan_and_its_simulation(capsys):
    args = ["--world-size", "8", "--pp", "2", "--microbatches", "4", "--schedule", "ZBV"]
    code, out, _ = run(capsys, *args, "--zero", "3", "--json")
    assert code == 0
    obj = json.loads(out)
    plan = PipelinePlan.from_json(obj["pipeline"])
    topo = Topology.create(8, pp=2)
    want = plan_pipeline(
        schedule="ZBV",
        microbatches=4,
        topology=topo,
        specs=builtin_model("gpt2-small"),
        zero3=True,
    )
    assert plan == want and plan.zero3
    assert obj["fingerprints"] == {"pipeline": want.fingerprint, "topology": topo.fingerprint}
    sim = simulate_pipeline(want, forward=1, backward=2, weight=1)
    assert obj["simulation"]["step_time"] == sim.step_time
    assert obj["simulation"]["peak_stash"] == list(sim.peak_stash)
    assert obj["kind"] == "plan_report"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--schedule", "1F1B"], "needs both --schedule NAME and --microbatches M"),
        (["--microbatches", "4"], "needs both --schedule NAME and --microbatches M"),
        (["--schedule", "PipeDream", "--microbatches", "4"], "unknown schedule 'PipeDream'"),
        (["--pp", "4", "--schedule", "1F1B", "--microbatches", "2"], "at least as many"),
        (["--schedule", "GPipe", "--microbatches", "0"], "--microbatches must be a positive"),
        (
            ["--pp", "2", "--schedule", "ZBV", "--microbatches", "4", "--stages-per-rank", "3"],
            "exactly 2 stages per rank",
        ),
        (
            ["--world-size", "2048", "--pp", "2048", "--schedule", "GPipe", "--microbatches", "1"],
            "--pp must be at most 1,024",
        ),
        (["--pp", "8", "--schedule", "GPipe", "--microbatches", "10000"], "more than 65,536"),
    ],
)
def test_bad_pipeline_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def _doc_runs():
    """Each bash block of docs/pipeline.md with the text block printed after it."""
    pairs = re.findall(r"```bash\n(.*?)```\n\n```text\n(.*?)```\n", DOC.read_text(), re.S)
    assert len(pairs) == 8  # the full output, then one chart per schedule
    return pairs


@pytest.mark.parametrize(("command", "printed"), _doc_runs(), ids=lambda s: s[:60])
def test_the_docs_charts_are_what_the_command_prints(command, printed, tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(pathlib.Path(sys.executable).parent), env["PATH"]])
    out = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout == printed
