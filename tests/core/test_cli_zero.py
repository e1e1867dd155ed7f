"""``gradsync plan --zero 0|1|2|3``: per-rank memory and ZeRO-3's units (docs/design.md §16)."""

import json
import subprocess
import sys

import pytest

from gradsync_core import (
    ParamShardPlan,
    block_prefixes,
    builtin_model,
    estimate_zero3,
    plan_param_shards,
)
from gradsync_core.cli._main import main


def run(capsys, *args):
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def test_zero3_text_lists_units_and_per_rank_bytes():
    out = subprocess.run(
        [sys.executable, "-m", "gradsync_core", "plan", "--zero", "3", "--world-size", "4"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "ZeRO-3 (parameters, gradients and state sharded" in out.stdout
    assert "Units: 13 (root first" in out.stdout and "'transformer.h.11'" in out.stdout
    assert "shard rank  params MiB  grads MiB  state MiB  transient MiB  peak MiB" in out.stdout
    assert "fullest: shard rank 0" in out.stdout


def test_zero3_json_is_the_plan_and_its_estimate(capsys):
    code, out, _ = run(capsys, "--zero", "3", "--world-size", "8", "--tp", "2", "--json")
    assert code == 0
    obj = json.loads(out)
    plan = ParamShardPlan.from_json(obj["param_shards"])
    specs = builtin_model("gpt2-small")
    assert plan == plan_param_shards(specs, world_size=4, units=block_prefixes(specs))
    assert obj["fingerprints"]["param_shards"] == plan.fingerprint
    tied = ["transformer.wte.weight"]  # gpt2-small's, by default
    assert obj["memory"] == estimate_zero3(plan, tied=tied).to_json()
    memory = obj["memory"]
    assert (memory["zero"], memory["version"], memory["world_size"]) == (3, 1, 4)
    assert set(memory["ranks"][0]) == {
        "rank",
        "parameter_bytes",
        "gradient_bytes",
        "optimizer_state_bytes",
        "transient_bytes",
        "peak_bytes",
    }
    assert obj["topology"]["tp"] == 2


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_zero_0_1_2_json(capsys, zero):
    code, out, _ = run(
        capsys, "--zero", str(zero), "--model", "mlp-25m", "--world-size", "4", "--json"
    )
    assert code == 0
    memory = json.loads(out)["memory"]
    ranks = memory["ranks"]
    assert memory["zero"] == zero and len(ranks) == 4
    params = 25_190_400 * 4
    assert ranks[0]["parameter_bytes"] == params
    state = [r["optimizer_state_bytes"] for r in ranks]
    if zero == 0:
        assert state == [2 * params] * 4
    else:  # 1/N of the state, up to the partition's balance
        assert sum(state) == 2 * params and max(state) < 2 * params / 4 * 1.1
    grads = ranks[0]["gradient_bytes"]
    assert grads == (params if zero < 2 else pytest.approx(params / 4, rel=0.01))


def test_hsdp_units_optimizer_and_a_parameter_file(capsys, tmp_path):
    path = tmp_path / "params.json"
    entries = [
        {"name": "emb.weight", "shape": [10, 4]},
        {"name": "blocks.0.w", "shape": [3, 4]},
        {"name": "blocks.1.w", "shape": [3, 4], "requires_grad": False},
    ]
    path.write_text(json.dumps(entries))
    args = ["--params", str(path), "--zero", "3", "--world-size", "4", "--json"]
    code, out, _ = run(capsys, *args, "--dp-shard", "2", "--units", "blocks.1", "--optimizer", "4")
    assert code == 0
    obj = json.loads(out)
    plan = ParamShardPlan.from_json(obj["param_shards"])
    assert (plan.shard_size, plan.replicate_size) == (2, 2)
    assert [u.prefix for u in plan.units] == ["", "blocks.1"]
    memory = obj["memory"]
    assert memory["optimizer_state_bytes_per_element"] == 4 and len(memory["ranks"]) == 2
    # shard rank 0: rows 0-4 of emb and 0-1 of blocks.0 (trainable) x 4 bytes of state
    assert memory["ranks"][0]["optimizer_state_bytes"] == 4 * (5 * 4 + 2 * 4)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--units", "h.0"], "--units applies to --zero 3 only"),
        (["--zero", "1", "--shard-size", "2"], "apply to --zero 3 only"),
        (["--zero", "1", "--tied", "transformer.wte.weight"], "apply to --zero 3 only"),
        (["--zero", "3", "--tied", "lm_head.weight"], "tied parameter 'lm_head.weight' is not"),
        (["--zero", "2", "--partition", "greedy"], "drop --partition greedy"),
        (["--zero", "3", "--shard-size", "3"], "--shard-size must divide the data-parallel size 8"),
        (["--zero", "3", "--dp-shard", "3"], "--dp-shard must divide the data-parallel size 8"),
        (["--zero", "2", "--dp-shard", "2"], "apply to --zero 3 only"),
        (["--zero", "3", "--dp-shard", "2", "--shard-size", "2"], "spelling of --dp-shard"),
        (["--zero", "3", "--units", "transformer.h.99"], "'transformer.h.99' matches no parameter"),
        (["--zero", "3", "--optimizer", "shampoo"], "unknown optimizer 'shampoo'"),
        (["--zero", "4"], "invalid choice: 4"),
        (["--zero", "0", "--world-size", "131072"], "more than 65,536"),
        (["--zero", "2", "--world-size", "65536"], "--bucket-cap-mb (ZeRO-2 needs the flat"),
    ],
    ids=[
        "units-without-3",
        "shard-size-without-3",
        "tied-without-3",
        "tied-unknown",
        "zero2-greedy",
        "shard-size",
        "dp-shard",
        "dp-shard-without-3",
        "both-spellings",
        "unit",
        "optimizer",
        "stage",
        "too-many-ranks",
        "zero2-too-many-pieces",
    ],
)
def test_bad_zero_input_is_one_line(capsys, args, message):
    code, out, err = run(capsys, *args)
    assert code == 2 and out == ""
    assert message in err and err.count("\n") == 1


def test_tied_weights_add_their_gradient_copies(capsys):
    def transient(*extra):
        code, out, _ = run(capsys, "--zero", "3", "--world-size", "4", "--json", *extra)
        assert code == 0
        return json.loads(out)["memory"]["ranks"][0]["transient_bytes"]

    untied = transient("--tied", "")
    # The root's backward: two more copies of wte's gradient replace the reduce-scatter input
    # of the root's gradients (wte padded to 4 x 12,565 rows, wpe, ln_f's weight and bias).
    wte, rest = 50260 * 768 * 4, (1024 + 2) * 768 * 4
    assert transient() == untied + 2 * wte - (wte + rest)
    assert transient("--tied", "transformer.wte.weight") == transient()


def test_plan_without_zero_has_no_memory_section(capsys):
    code, out, _ = run(capsys, "--world-size", "4", "--json")
    assert code == 0
    assert set(json.loads(out)) == {
        *("kind", "version", "buckets", "shards", "topology", "fingerprints"),
        *("slots", "owners"),  # the plans' facts by name (version 2 of the report)
    }


def test_shard_size_is_the_deprecated_spelling_of_dp_shard(capsys):
    """The old flag plans the same, with one warning line on stderr; --dp-shard is the
    topology's: its JSON and groups carry the split."""
    args = ["--zero", "3", "--world-size", "8", "--json"]
    code, new, err = run(capsys, *args, "--dp-shard", "2")
    assert code == 0 and err == ""
    code, old, err = run(capsys, *args, "--shard-size", "2")
    assert code == 0 and old == new
    assert (
        err == "gradsync: warning: --shard-size is deprecated and will be removed: use --dp-shard\n"
    )
    obj = json.loads(new)
    assert obj["topology"]["dp_shard"] == 2 and obj["param_shards"]["shard_size"] == 2
    code, out, _ = run(capsys, "--world-size", "8", "--dp-shard", "4")
    assert code == 0 and "dp_replicate" in out and "'dp_replicate', 'dp_shard'" in out
