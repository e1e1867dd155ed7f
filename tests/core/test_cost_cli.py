"""``gradsync plan --cost`` / ``--search`` and ``gradsync calibrate``'s argument checks
(docs/cost-model.md): what they print, their JSON, and one sentence for bad input."""

import json

import pytest

from gradsync_core import builtin_model
from gradsync_core.cli._cost import parse_bytes
from gradsync_core.cli._main import main
from gradsync_core.plan import BlockTime, ModelProfile, profile_blocks

MACHINE = "examples/machine-profiles/h100-nvlink-node.json"


@pytest.fixture(scope="module")
def model_profile(tmp_path_factory):
    """A hand-written profile of gpt2-small: 2 ms forward, 4 ms backward per block."""
    blocks = profile_blocks(builtin_model("gpt2-small"))
    profile = ModelProfile(
        samples=8,
        source="given",
        optimizer_s=0.01,
        blocks=tuple(
            BlockTime(prefix=p, forward_s=2e-3, backward_s=4e-3, activation_bytes=64 << 20)
            for p in blocks
        ),
    )
    path = tmp_path_factory.mktemp("profiles") / "gpt2.json"
    path.write_text(json.dumps(profile.to_json()))
    return str(path)


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_cost_prints_the_step_its_collectives_and_memory(capsys, model_profile):
    code, out, _ = run(capsys, "--cost", MACHINE, "--model-profile", model_profile, "--zero", "3")
    assert code == 0
    assert out.startswith("Cost of zero3 reshard for gpt2-small on 8 ranks (dp 8, pp 1)")
    assert "step " in out and " = compute " in out and "exposed communication" in out
    assert "unit 1 all-gather (forward)" in out and "unit 0 reduce-scatter" in out
    assert "fullest: shard rank" in out and "fingerprints: param_shards" in out


def test_cost_json_is_the_prediction(capsys, model_profile):
    args = ["--cost", MACHINE, "--model-profile", model_profile, "--bucket-cap-mb", "4", "--json"]
    code, out, _ = run(capsys, *args)
    assert code == 0
    report = json.loads(out)
    prediction = report["prediction"]
    assert prediction["configuration"]["bucket_cap_mb"] == 4
    cost = prediction["cost"]
    assert cost["step_s"] == pytest.approx(cost["compute_s"] + cost["exposed_comm_s"])
    assert {c["collective"] for c in cost["comms"]} == {"all_reduce"}
    assert len(cost["ranks"]) == 8


def test_cost_of_a_pipeline_and_of_a_flop_estimate(capsys, model_profile):
    args = ["--cost", MACHINE, "--model-profile", model_profile, "--pp", "2"]
    code, out, _ = run(capsys, *args, "--schedule", "1F1B", "--microbatches", "4")
    assert code == 0 and "Cost of pp2 1F1B m4" in out and "SEND_F" in out
    code, out, _ = run(capsys, "--cost", MACHINE, "--tokens", "8192")
    assert code == 0 and "model profile flops" in out and "a FLOP estimate" in out


def test_cost_executor_jax_prices_zero3s_peak_as_one_xla_program(capsys, model_profile):
    """``--executor jax``: the same plan and step time, the peak of zero3_step's program."""
    args = ["--cost", MACHINE, "--model-profile", model_profile, "--zero", "3", "--json"]
    predictions = {}
    for executor in ("torch", "jax"):
        code, out, _ = run(capsys, *args, "--executor", executor, "--keep-after-forward")
        assert code == 0
        predictions[executor] = json.loads(out)["prediction"]
    torch, jax = predictions["torch"], predictions["jax"]
    assert jax["fingerprints"] == torch["fingerprints"]
    assert jax["cost"]["step_s"] == torch["cost"]["step_s"]
    assert jax["cost"]["peak_bytes"] < torch["cost"]["peak_bytes"]


def test_search_prints_the_fastest_that_fit_and_why_others_were_dropped(capsys, model_profile):
    args = ["--cost", MACHINE, "--model-profile", model_profile, "--search"]
    code, out, _ = run(capsys, *args, "--memory-per-rank", "2GiB", "--top", "3")
    assert code == 0
    assert "memory per rank 2,048.00 MiB" in out and " fit, " in out
    assert "is over the 2.00 GiB per rank" in out
    assert "best: " in out
    code, out, _ = run(capsys, *args, "--json")
    search = json.loads(out)["search"]
    steps = [p["cost"]["step_s"] for p in search["ranked"]]
    assert steps == sorted(steps) and len(steps) == 5  # --top's default


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--search"], "give --cost MACHINE.json"),
        (["--cost", MACHINE], "--cost needs --model-profile"),
        (["--cost", MACHINE, "--tokens", "1", "--tp", "2"], "drop --tp, --cp and --ep"),
        (["--cost", "missing.json", "--tokens", "1"], "cannot read the machine profile"),
        (["--cost", MACHINE, "--tokens", "8", "--memory-per-rank", "1G"], "applies to --search"),
        (["--cost", MACHINE, "--tokens", "8", "--search", "--memory-per-rank", "lots"], "80GiB"),
        (["--cost", MACHINE, "--tokens", "8", "--global-batch", "12"], "does not split"),
    ],
    ids=[
        "no machine",
        "no model",
        "tp",
        "missing file",
        "limit without search",
        "bad size",
        "batch",
    ],
)
def test_bad_cost_input_is_one_sentence(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("gradsync: error: ") and message in err and err.count("\n") == 1


def test_a_bad_model_profile_file_is_one_sentence(capsys, tmp_path):
    bad = tmp_path / "model.json"
    bad.write_text(json.dumps({"kind": "model_profile", "version": 1, "samples": 8}))
    code, _, err = run(capsys, "--cost", MACHINE, "--model-profile", str(bad))
    assert code == 2 and "a model profile lacks the key 'source'" in err


@pytest.mark.parametrize(
    ("text", "nbytes"), [("80GiB", 80 << 30), ("40GB", 40 * 10**9), ("1.5 MiB", 3 << 19), ("7", 7)]
)
def test_sizes(text, nbytes):
    assert parse_bytes(text) == nbytes


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--sizes-kib", "64"], "two different sizes"),
        (["--sizes-kib", "a,b"], "comma-separated ints"),
        (["--repeats", "0"], "--repeats must be between 1"),
        (["--world-size", "1"], "--world-size must be between 2"),
    ],
    ids=["one size", "not ints", "repeats", "world"],
)
def test_calibrate_refuses_bad_options_before_measuring(capsys, args, message):
    code = main(["calibrate", *args])
    _, err = capsys.readouterr()
    assert code == 2 and message in err
