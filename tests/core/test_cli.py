"""The ``gradsync`` command line, run as a user runs it: a subprocess."""

import json
import subprocess
import sys
import time
import tracemalloc

import pytest

from gradsync_core import BucketPlan, ShardPlan, Topology
from gradsync_core.cli._main import main
from tests.support.checkpoints import write_checkpoint


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
    assert "Model gpt2-small: 124,439,808 trainable parameters in 148 tensors" in out.stdout
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
    # The same facts by name, beside the canonical (positional) plans: a versioned report.
    assert (obj["kind"], obj["version"]) == ("plan_report", 2)
    assert obj["owners"] == [
        {"name": s.name, "rank": s.rank, "start": s.start, "stop": s.stop, "group": s.group}
        for s in shards.shards
    ]
    slots = [(i, s) for i, b in enumerate(buckets.buckets) for s in b.slots]
    assert obj["slots"] == [
        {"bucket": i, "name": s.name, "shape": list(s.shape), "offset": s.offset} for i, s in slots
    ]


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
    assert "in 3 tensors (2 trainable)" in out.stdout and "bfloat16" in out.stdout


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
        (["plan", "--world-size", "1000000000"], "--world-size must be between 1 and 1,048,576"),
        (["plan", "--world-size", "1048577"], "got 1,048,577"),
        (["plan", "--world-size", "0"], "--world-size must be between 1"),
        (["plan", "--tp", "2097152"], "--tp must be between 1 and 1,048,576"),
        (["plan", "--pp", "-4"], "--pp must be between 1"),
        (["plan", "--pad-to", "0"], "--pad-to must be between 1"),
        (["plan", "--bucket-cap-mb", "inf"], "--bucket-cap-mb must be at most 65,536"),
        (["plan", "--bucket-cap-mb", "nan"], "--bucket-cap-mb must be positive, got nan"),
        (["plan", "--bucket-cap-mb", "1e300"], "--bucket-cap-mb must be at most"),
        (["plan", "--bucket-cap-mb", "0"], "--bucket-cap-mb must be positive"),
        (
            ["plan", "--world-size", "1048576", "--partition", "flat"],
            "more than 131,072; raise --bucket-cap-mb or use --partition greedy",
        ),
    ],
    ids=[
        "unknown-model",
        "not-divisible",
        "no-file",
        "negative-cap",
        "not-an-int",
        "repeated-axis",
        "unknown-command",
        "world-1e9",
        "world-just-over",
        "world-zero",
        "tp-over",
        "pp-negative",
        "pad-to-zero",
        "cap-inf",
        "cap-nan",
        "cap-huge",
        "cap-zero",
        "flat-too-many-pieces",
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
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('[{"name": "w", "shape": [2], "requires_grad": "no"}]', "'requires_grad' must be true"),
        ('[{"name": "w", "shape": [2], "requires_grad": 0}]', "got 0"),
        ('[{"name": "w", "shape": [2.0]}]', "list of non-negative ints"),
        ('[{"name": "w", "shape": [-1]}]', "list of non-negative ints"),
        ('[{"name": "w", "shape": [true]}]', "list of non-negative ints"),
        ('[{"name": "w", "shape": "2"}]', "list of non-negative ints"),
        ('[{"name": "", "shape": [2]}]', "'name' must be a non-empty string"),
        ('[{"name": 7, "shape": [2]}]', "'name' must be a non-empty string"),
        ('[{"name": "w", "shape": [2], "dtype": 4}]', "'dtype' must be a string"),
        ('[{"name": "w", "shape": [2], "device": null}]', "'device' must be a non-empty"),
        ('[{"name": "w", "shape": [2], "replicated_over": "tp"}]', "list of axis names"),
        ('[{"name": "w", "shape": [' + "9" * 5000 + "]}]", "is not usable JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
    ids=[
        "malformed",
        "empty",
        "missing-shape",
        "duplicate",
        "bad-dtype",
        "deeply-nested",
        "requires-grad-string",
        "requires-grad-int",
        "shape-float",
        "shape-negative",
        "shape-bool",
        "shape-string",
        "name-empty",
        "name-number",
        "dtype-number",
        "device-null",
        "replicated-over-string",
        "huge-int-literal",
        "entry-not-object",
    ],
)
def test_bad_parameter_files(tmp_path, content, message):
    path = tmp_path / "params.json"
    path.write_text(content)
    out = gradsync("plan", "--params", str(path))
    assert out.returncode == 2 and message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert len(out.stderr) < 400


def test_parameter_file_over_the_size_cap(tmp_path, monkeypatch, capsys):
    import gradsync_core.cli._main as cli

    monkeypatch.setattr(cli, "MAX_PARAMS_FILE_BYTES", 100)  # writing 64 MiB would be slow
    path = tmp_path / "params.json"
    path.write_text(json.dumps([{"name": f"w{i}", "shape": [2]} for i in range(10)]))
    assert main(["plan", "--params", str(path)]) == 2
    err = capsys.readouterr().err
    assert "is larger than 0 MiB" in err and err.count("\n") == 1


def test_help_states_the_maxima():
    out = gradsync("plan", "--help")
    assert out.returncode == 0
    text = " ".join(out.stdout.split())
    for maximum in ("1 to 1,048,576", "at most 65,536", "at most 64 MiB", "131,072 pieces"):
        assert maximum in text


@pytest.mark.slow
@pytest.mark.parametrize(
    "args",
    [
        ["--world-size", "1048576"],
        [
            "--world-size",
            "1048576",
            "--tp",
            "8",
            "--cp",
            "2",
            "--pp",
            "4",
            "--order",
            "dp-tp-cp-ep-pp",
        ],
        ["--world-size", "1048576", "--json"],
        ["--world-size", "1048576", "--tp", "1024", "--partition", "flat", "--json"],
    ],
    ids=["dp-only", "4d-dp-fastest", "json", "flat"],
)
def test_a_million_ranks_plan_in_bounded_time_and_memory(args, capsys):
    argv = ["plan", "--model", "gpt2-small", *args]
    start = time.perf_counter()
    assert main(argv) == 0
    elapsed = time.perf_counter() - start
    out = capsys.readouterr().out
    assert elapsed < 2.0, f"{elapsed:.2f} s"  # about 0.5 s on one core
    # Again in-process under tracemalloc, which sees every allocation the planner and the
    # printer make (and would have inflated the time above).
    tracemalloc.start()
    try:
        assert main(argv) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert capsys.readouterr().out == out  # deterministic
    assert peak < 1 << 30, f"{peak / 2**20:.0f} MiB"
    if "flat" not in args:  # a flat plan's JSON lists its pieces; the others are summaries
        assert len(out) < 64 * 1024
    if "--json" not in args:
        assert "Rank groups: " in out and "1048576" in out.replace(",", "")


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


# -- gradsync checkpoint inspect -----------------------------------------------------------


def test_checkpoint_inspect_verifies_and_describes(tmp_path):
    plan, owner = write_checkpoint(tmp_path)
    out = gradsync("checkpoint", "inspect", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert "every file matches its sha256" in out.stdout
    assert "written by torch (torch.optim.Adam), format version 2, step 7, world size 2" in (
        out.stdout
    )
    assert f"fingerprint {plan.fingerprint}" in out.stdout
    assert "parameters: 3 (2 trainable); model weights: 1 stored" in out.stdout
    assert "data position: not stored (saved without data=)" in out.stdout
    assert "saved under: not recorded" in out.stdout

    out = gradsync("checkpoint", "inspect", "--json", str(tmp_path))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert (info["framework"], info["step"], info["world_size"]) == ("torch", 7, 2)
    assert info["plan_fingerprint"] == plan.fingerprint and info["partition"] == "greedy"
    for entry in info["ranks"]:
        rank = entry["rank"]
        assert entry["owners"] == [n for n, r in owner.items() if r == rank]
        assert entry["bytes"] == (tmp_path / entry["file"]).stat().st_size
        assert entry["state_bytes"] == 4 * sum(
            {"fc.weight": 4, "fc.bias": 2}[n] for n in entry["owners"]
        )
        assert entry["model_bytes"] == (12 if rank == 0 else 0)


def test_checkpoint_inspect_shows_the_data_position(tmp_path):
    from gradsync_core import DataCursor

    cursor = DataCursor(epoch=3, consumed=48, seed=7, dataset_size=100, shuffle=True)
    write_checkpoint(tmp_path, position=cursor.to_json())
    out = gradsync("checkpoint", "inspect", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (
        "data position: epoch 3, 48 samples consumed (seed 7, dataset size 100, shuffle True)"
        in out.stdout
    )
    out = gradsync("checkpoint", "inspect", "--json", str(tmp_path))
    assert json.loads(out.stdout)["data"] == cursor.to_json()


def test_checkpoint_inspect_shows_the_layout_it_was_saved_under(tmp_path):
    from gradsync_core.checkpoint import layout_record

    topology = Topology.create(8, tp=2, pp=2)
    record = layout_record(
        topology, framework="torch", schedule="1F1B", microbatches=2, model={"dim": 32}
    )
    write_checkpoint(tmp_path, layout=record)
    out = gradsync("checkpoint", "inspect", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert (
        "saved under: torch, dp 2 x tp 2 x pp 2 (8 ranks), pipeline 1F1B with 2 microbatches"
        in out.stdout
    )
    out = gradsync("checkpoint", "inspect", "--json", str(tmp_path))
    assert json.loads(out.stdout)["layout"] == record
    hsdp = layout_record(Topology.create(8, tp=2, dp_shard=2), framework="jax")
    write_checkpoint(tmp_path, layout=hsdp)
    out = gradsync("checkpoint", "inspect", str(tmp_path))
    assert "saved under: jax, dp_replicate 2 x dp_shard 2 x tp 2 (8 ranks)" in out.stdout


def test_a_manifest_with_a_bad_layout_is_refused(tmp_path):
    from gradsync_core import read_manifest

    write_checkpoint(tmp_path, layout={"topology": {"kind": "topology", "tp": "two"}})
    with pytest.raises(ValueError, match=r"'extra\.layout\.topology' is not a topology"):
        read_manifest(tmp_path)


def test_a_manifest_with_a_bad_data_position_is_refused(tmp_path):
    from gradsync_core import read_manifest

    write_checkpoint(tmp_path, position={"kind": "data_cursor", "epoch": "one"})
    with pytest.raises(ValueError, match=r"manifest field 'extra\.data' is not a data cursor"):
        read_manifest(tmp_path)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("flip", "does not match its manifest hash: corrupt or from another save"),
        ("delete", "rank-00001-of-00002.safetensors is missing"),
        ("manifest", "does not match its own checksum"),
        ("no-dir", "is not a directory; pass a gradsync checkpoint directory"),
        ("empty-dir", "has no manifest.json: not a gradsync checkpoint"),
    ],
    ids=["flipped-byte", "missing-file", "edited-manifest", "no-such-path", "not-a-checkpoint"],
)
def test_checkpoint_inspect_refuses_bad_checkpoints(tmp_path, damage, message):
    directory = tmp_path / "ckpt"
    directory.mkdir()
    write_checkpoint(directory)
    rank1 = directory / "rank-00001-of-00002.safetensors"
    if damage == "flip":
        data = bytearray(rank1.read_bytes())
        data[-1] ^= 0x01
        rank1.write_bytes(bytes(data))
    elif damage == "delete":
        rank1.unlink()
    elif damage == "manifest":
        manifest = directory / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"step": 7', '"step": 8'))
    elif damage == "no-dir":
        directory = tmp_path / "nothing"
    else:
        directory = tmp_path / "empty"
        directory.mkdir()
    out = gradsync("checkpoint", "inspect", str(directory))
    assert out.returncode == 2
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert out.stdout == ""
