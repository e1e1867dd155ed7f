"""The ``gradsync`` command line, run as a user runs it: a subprocess."""

import json
import subprocess
import sys

import pytest

from gradsync_core import BucketPlan, ShardPlan, Topology


def gradsync(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "gradsync_core", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=60,
    )


def test_default_plan_prints_the_three_tables():
    out = gradsync("plan")
    assert out.returncode == 0, out.stderr
    assert "Model gpt2-small: 148 parameters" in out.stdout
    assert "124,439,808 trainable elements" in out.stdout
    for heading in ("Buckets: ", "Shard partition: greedy over 8", "Rank groups: "):
        assert heading in out.stdout


def test_json_output_is_the_plans():
    out = gradsync(
        "plan",
        "--model",
        "resnet50",
        "--world-size",
        "8",
        "--tp",
        "2",
        "--partition",
        "flat",
        "--bucket-cap-mb",
        "5",
        "--json",
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    buckets = BucketPlan.from_json(obj["buckets"])
    shards = ShardPlan.from_json(obj["shards"])
    topo = Topology.from_json(obj["topology"])
    assert (topo.tp, topo.dp) == (2, 4)
    assert buckets.cap_bytes == 5 * 1024 * 1024 and buckets.pad_to == 4
    assert shards.kind == "flat" and shards.world_size == 4
    assert obj["fingerprints"]["buckets"] == buckets.fingerprint


def test_user_parameter_file(tmp_path):
    path = tmp_path / "params.json"
    path.write_text(
        json.dumps(
            {
                "params": [
                    {"name": "emb.weight", "shape": [1000, 64]},
                    {"name": "head.weight", "shape": [10, 64], "dtype": "bfloat16"},
                    {"name": "frozen", "shape": [5], "requires_grad": False},
                ]
            }
        )
    )
    out = gradsync("plan", "--params", str(path), "--world-size", "2")
    assert out.returncode == 0, out.stderr
    assert "3 parameters (2 trainable)" in out.stdout and "bfloat16" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["plan", "--model", "gpt5"], "unknown model 'gpt5'"),
        (["plan", "--world-size", "8", "--tp", "3"], "does not divide world_size = 8"),
        (["plan", "--params", "/nonexistent.json"], "cannot read parameter file"),
        (["plan", "--bucket-cap-mb", "-1"], "--bucket-cap-mb must be positive"),
        (["plan", "--world-size", "two"], "invalid int value: 'two'"),
        (["plan", "--order", "tp-tp"], "distinct axes"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(args, message):
    out = gradsync(*args)
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stdout == ""


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "is not valid JSON"),
        ("[]", "must hold a non-empty list"),
        ('[{"name": "w"}]', "needs at least 'name' and 'shape'"),
        ('[{"name": "w", "shape": [2]}, {"name": "w", "shape": [2]}]', "appears twice"),
        ('[{"name": "w", "shape": [2], "dtype": "float31"}]', "unknown dtype"),
    ],
    ids=["malformed", "empty", "missing-shape", "duplicate", "bad-dtype"],
)
def test_bad_parameter_files(tmp_path, content, message):
    path = tmp_path / "params.json"
    path.write_text(content)
    out = gradsync("plan", "--params", str(path))
    assert out.returncode == 2 and message in out.stderr
    assert out.stderr.count("\n") == 1


def test_console_script_is_installed():
    import shutil

    exe = shutil.which("gradsync") or str(
        __import__("pathlib").Path(sys.executable).parent / "gradsync"
    )
    out = subprocess.run(
        [exe, "plan", "--model", "mlp-25m", "--world-size", "2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "Model mlp-25m" in out.stdout
