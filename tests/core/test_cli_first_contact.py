"""What a new user meets first on the command line (issue 22 item 7): every message says what
it is and where to look."""

import json

import pytest

from gradsync_core import ShardPlan, __version__, plan_flat_shards
from gradsync_core.cli._main import main
from gradsync_core.plan._buckets import plan_param_buckets
from gradsync_core.plan._models import builtin_model


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"gradsync {__version__}"


@pytest.mark.parametrize(
    "argv, expected",
    [
        (
            ["plan", "--wrold-size", "4"],
            "unknown flag '--wrold-size'; did you mean '--world-size'? "
            "(see 'gradsync plan --help')",
        ),
        (["plan", "--bucket-cpa-mb=5"], "did you mean '--bucket-cap-mb'?"),
        (["plan", "--jsno"], "unknown flag '--jsno'; did you mean '--json'?"),
        (["plan", "stray"], "unexpected arguments 'stray' (see 'gradsync plan --help')"),
        (
            ["checkpoint", "inspect", "--jsn", "x"],
            "did you mean '--json'? (see 'gradsync checkpoint inspect --help')",
        ),
    ],
    ids=["typo", "with-value", "json", "positional", "nested-subcommand"],
)
def test_flag_typos_point_at_the_subcommand_help(capsys, argv, expected):
    code, _, err = run(capsys, *argv)
    assert code == 2
    assert expected in err, err


def test_partition_auto_is_flat_by_parameter_as_shard_optimizer_picks_for_adam(capsys):
    code, out, err = run(capsys, "plan", "--model", "mlp-25m", "--partition", "auto", "--json")
    assert code == 0, err
    auto = json.loads(out)
    code, out, _ = run(capsys, "plan", "--model", "mlp-25m", "--partition", "flat", "--json")
    flat = json.loads(out)
    assert auto["buckets"] == flat["buckets"]  # the gradient buckets do not change
    shards = ShardPlan.from_json(auto["shards"])
    assert shards.kind == "flat"
    # shard_optimizer's auto layout: every rank holds one element range of every parameter
    ranks = auto["topology"]["dp"]
    by_param = plan_param_buckets(builtin_model("mlp-25m"), pad_to=ranks)
    assert shards == plan_flat_shards(by_param, world_size=ranks)
    code, out, err = run(capsys, "plan", "--model", "mlp-25m", "--partition", "auto", "--zero", "1")
    assert code == 0, err


def test_unknown_params_key_lists_the_valid_keys(capsys, tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"name": "w", "shape": [3], "replicated": ["tp"]}]))
    code, _, err = run(capsys, "plan", "--params", str(path))
    assert code == 2
    assert "unknown keys ['replicated']" in err
    for key in ("name", "shape", "dtype", "requires_grad", "device", "replicated_over", "expert"):
        assert key in err.split("valid keys are")[1]


def test_parameters_are_parameters_and_tensors_are_tensors(capsys):
    code, out, _ = run(capsys, "plan")
    assert code == 0
    assert "124,439,808 trainable parameters in 148 tensors (148 trainable)" in out
    assert "148 parameters" not in out
    assert "tensors" in out.splitlines()[3]  # the bucket table counts tensors, not parameters
    code, out, _ = run(capsys, "plan", "--zero", "1")
    assert "124,439,808 parameters in 148 tensors" in out


def test_a_bucket_over_its_cap_says_why(capsys):
    code, out, _ = run(capsys, "plan", "--bucket-cap-mb", "1")
    assert code == 0
    rows = [line for line in out.splitlines() if "float32" in line]
    fills = [row.split("1.00", 2)[-1].strip() for row in rows]
    assert "over cap: last tensor pushed it over" in fills
    assert not any(fill.endswith("%") and int(fill[:-1]) > 100 for fill in fills)
    # one tensor alone larger than the cap: the embedding, 147 MiB, with a 100 MiB cap
    code, out, _ = run(capsys, "plan", "--bucket-cap-mb", "100")
    assert "over cap: one tensor larger than the cap" in out


@pytest.mark.parametrize("axis", ["--tp", "--pp", "--ep"])
def test_model_parallel_sizes_say_the_shapes_are_used_as_given(capsys, axis):
    code, out, _ = run(capsys, "plan", "--world-size", "8", axis, "2")
    assert code == 0
    assert f"note: with {axis} 2, buckets and shards use the parameter shapes as given" in out
    code, out, _ = run(capsys, "plan", "--world-size", "8", "--cp", "2")
    assert "note:" not in out


def test_partition_auto_takes_the_bucketed_layout_when_a_parameter_has_no_elements(
    capsys, tmp_path
):
    # shard_optimizer's auto does the same: a zero-size parameter has no element range.
    path = tmp_path / "p.json"
    path.write_text(json.dumps([{"name": "w", "shape": [0, 3]}, {"name": "b", "shape": [4]}]))
    plans = {}
    for partition in ("auto", "flat"):
        code, out, err = run(capsys, "plan", "--params", str(path), "--partition", partition)
        assert code == 0, err
        plans[partition] = out
    assert plans["auto"] == plans["flat"]
    code, _, err = run(
        capsys, "plan", "--model", "gpt2-small", "--partition", "auto", "--world-size", "1048576"
    )
    assert code == 2 and "more than 131,072; use --partition greedy" in err, err
