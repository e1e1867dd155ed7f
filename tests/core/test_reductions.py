"""Shared-parameter reductions are derived from how parameters and tokens are sharded."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    MODEL_AXES,
    ParamSpec,
    ReductionPlan,
    Topology,
    plan_buckets,
    plan_shared_reductions,
    reduction_group,
    replicated_axes,
    with_replicated_over,
)
from gradsync_core.plan._reductions import split_expert_specs

# (sharded_over, data_sharded_over, expected): the reference block's parameters.
RULES = {
    "plain-tp-column-weight": (("tp",), (), ()),
    "plain-tp-row-bias": ((), (), ()),  # tokens replicated over tp: copy-to already summed
    "cp-column-weight": (("tp",), ("dp", "cp"), ("cp",)),
    "cp-row-bias": ((), ("dp", "cp"), ("cp",)),
    "cp-final-norm": ((), ("cp",), ("cp",)),
    "sequence-parallel-norm": ((), ("cp", "tp"), ("tp", "cp")),
    "sequence-parallel-row-bias": ((), ("tp",), ("tp",)),
    "sequence-parallel-column-weight": (("tp",), ("tp", "cp"), ("cp",)),
    "expert-weight": (("ep",), ("ep",), ()),
    "dp-only": ((), ("dp",), ()),
}


@pytest.mark.parametrize("case", list(RULES.values()), ids=list(RULES))
def test_replicated_axes_rule(case):
    sharded, data, expected = case
    assert replicated_axes(sharded_over=sharded, data_sharded_over=data) == expected


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"data_sharded_over": ("pp",)}, "pipeline stages do not split"),
        ({"data_sharded_over": ("sp",)}, "unknown axes"),
        ({"sharded_over": "tp"}, "sequence of axis names"),
    ],
    ids=["pp-data", "unknown-axis", "bare-string"],
)
def test_replicated_axes_rejects(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        replicated_axes(**kwargs)


TOPO = Topology.create(world_size=8, tp=2, cp=2)  # dp=2, ep=1


@pytest.mark.parametrize(
    ("axes", "group"),
    [
        ((), None),
        (("cp",), "cp"),
        (("tp",), "tp"),
        (("cp", "tp"), "tp-cp"),  # spelled in AXES order, whatever the input order
        (("ep",), None),  # ep=1: a singleton axis costs nothing
        (("tp", "ep", "cp"), "tp-cp"),
    ],
)
def test_reduction_group_drops_singletons_and_orders_axes(axes, group):
    assert reduction_group(axes, TOPO) == group


@pytest.mark.parametrize(
    ("axes", "match"),
    [(("dp",), "data-parallel mean"), (("pp",), "pp stages"), (("cp", "cp"), "repeats")],
)
def test_reduction_group_rejects(axes, match):
    with pytest.raises(ValueError, match=match):
        reduction_group(axes, TOPO)


def _block_specs(sequence_parallel: bool) -> list[ParamSpec]:
    """The reference transformer block under tp x cp, replicated_over derived by the rule."""
    data = ("dp", "cp", "tp") if sequence_parallel else ("dp", "cp")
    layout = [
        ("ln.weight", (8,), ()),
        ("ln.bias", (8,), ()),
        ("fc1.weight", (5, 8), ("tp",)),
        ("fc1.bias", (5,), ("tp",)),
        ("fc2.weight", (8, 5), ("tp",)),
        ("fc2.bias", (8,), ()),
        ("norm.weight", (8,), ()),
        ("norm.bias", (8,), ()),
    ]
    return [
        ParamSpec(
            name=name,
            shape=shape,
            replicated_over=replicated_axes(sharded_over=sharded, data_sharded_over=data),
        )
        for name, shape, sharded in layout
    ]


def test_final_norm_is_summed_over_cp_without_any_mark():
    plan = plan_shared_reductions(_block_specs(sequence_parallel=False), TOPO)
    assert plan.group_names == ("cp",)
    assert set(plan.reduction("cp").names) == {
        "ln.weight",
        "ln.bias",
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
        "norm.weight",
        "norm.bias",
    }
    assert plan.group_of("norm.weight") == "cp"


def test_sequence_parallel_adds_the_tp_cp_group_for_norms_and_row_bias():
    plan = plan_shared_reductions(_block_specs(sequence_parallel=True), TOPO)
    assert plan.group_names == ("cp", "tp-cp")
    assert set(plan.reduction("tp-cp").names) == {
        "ln.weight",
        "ln.bias",
        "fc2.bias",
        "norm.weight",
        "norm.bias",
    }
    assert set(plan.reduction("cp").names) == {"fc1.weight", "fc1.bias", "fc2.weight"}


def test_plain_tensor_parallel_needs_no_extra_sum():
    topo = Topology.create(world_size=4, tp=2)
    plan = plan_shared_reductions(_block_specs(sequence_parallel=False), topo)
    assert plan.reductions == ()
    assert plan.group_of("fc2.bias") is None


def test_each_group_uses_ddp_buckets_of_its_members():
    specs = _block_specs(sequence_parallel=True)
    plan = plan_shared_reductions(specs, TOPO, cap_bytes=64, first_cap_bytes=32)
    for reduction in plan.reductions:
        members = [s for s in specs if s.name in reduction.names]
        assert reduction.buckets == plan_buckets(members, cap_bytes=64, first_cap_bytes=32)
    # bucket 0 holds the last-registered parameters (first ready in backward)
    assert plan.reduction("tp-cp").buckets.buckets[0].slots[-1].name == "norm.bias"


def test_frozen_parameters_get_no_reduction():
    specs = [
        ParamSpec(name="a", shape=(3,), replicated_over=("cp",), requires_grad=False),
        ParamSpec(name="b", shape=(3,), replicated_over=("tp",), requires_grad=False),
        ParamSpec(name="c", shape=(3,), replicated_over=("tp",)),
    ]
    plan = plan_shared_reductions(specs, TOPO)
    assert plan.group_names == ("tp",)
    assert plan.group_of("a") is None and plan.reduction("tp").names == ("c",)


def test_bad_replicated_over_names_the_parameter():
    specs = [ParamSpec(name="emb.weight", shape=(4,), replicated_over=("dp",))]
    with pytest.raises(ValueError, match=r"'emb.weight'.*data-parallel mean"):
        plan_shared_reductions(specs, TOPO)


def test_with_replicated_over_sets_and_checks_names():
    specs = [ParamSpec(name="w", shape=(2,)), ParamSpec(name="b", shape=(2,))]
    out = with_replicated_over(specs, {"b": ("cp",)})
    assert [s.replicated_over for s in out] == [(), ("cp",)]
    with pytest.raises(ValueError, match="not parameters here"):
        with_replicated_over(specs, {"nope": ("cp",)})


def test_json_round_trip_and_fingerprint():
    plan = plan_shared_reductions(_block_specs(sequence_parallel=True), TOPO)
    text = json.dumps(plan.to_json())
    again = ReductionPlan.from_json(json.loads(text))
    assert again == plan and again.fingerprint == plan.fingerprint
    other = plan_shared_reductions(_block_specs(sequence_parallel=False), TOPO)
    assert other.fingerprint != plan.fingerprint
    with pytest.raises(ValueError, match="reduction_plan"):
        ReductionPlan.from_json({**plan.to_json(), "kind": "bucket_plan"})


_axes = st.lists(st.sampled_from(MODEL_AXES), unique=True, max_size=3)


@settings(max_examples=60, deadline=None)
@given(
    layout=st.lists(st.tuples(_axes, st.integers(1, 64)), min_size=1, max_size=12),
    sizes=st.tuples(*[st.sampled_from([1, 2, 3])] * 3),
)
def test_every_replicated_parameter_is_reduced_exactly_once(layout, sizes):
    tp, cp, ep = sizes
    topo = Topology.create(world_size=tp * cp * ep * 2, tp=tp, cp=cp, ep=ep)
    specs = [
        ParamSpec(name=f"p{i}", shape=(n,), replicated_over=tuple(axes))
        for i, (axes, n) in enumerate(layout)
    ]
    plan = plan_shared_reductions(specs, topo, cap_bytes=128)
    seen = [name for r in plan.reductions for name in r.names]
    assert len(seen) == len(set(seen))
    for spec in specs:
        # ep is carved out of the dense dp: the data-parallel mean covers it.
        live = [a for a in spec.replicated_over if a != "ep" and getattr(topo, a) > 1]
        group = plan.group_of(spec.name)
        assert (group is None) == (not live)
        if group is not None:
            assert set(group.split("-")) == set(live)
            assert topo.group_size(group) > 1
    assert ReductionPlan.from_json(plan.to_json()) == plan


# --- expert parameters ---------------------------------------------------------------


def _moe_specs() -> list[ParamSpec]:
    return [
        ParamSpec(name="router.weight", shape=(4, 8)),
        ParamSpec(name="norm.weight", shape=(8,), replicated_over=("cp",)),
        ParamSpec(name="experts.0.fc1.weight", shape=(16, 8), expert=True),
        ParamSpec(name="experts.0.fc2.bias", shape=(8,), expert=True, replicated_over=("tp",)),
        ParamSpec(name="frozen.expert", shape=(3,), expert=True, requires_grad=False),
    ]


@pytest.mark.parametrize(
    ("kwargs", "groups", "bias_group"),
    [
        ({"world_size": 4, "ep": 2}, ("edp",), "edp"),
        ({"world_size": 8, "cp": 2, "ep": 2}, ("cp", "edp"), "edp"),
        ({"world_size": 8, "tp": 2, "ep": 2}, ("etp", "edp"), "etp"),
        ({"world_size": 8, "tp": 2, "ep": 4, "etp": 1}, ("edp",), "edp"),
    ],
    ids=["ep2", "cp2-ep2", "tp2-ep2-etp2", "tp2-ep4-etp1"],
)
def test_expert_gradients_are_summed_over_edp_and_divided_by_dp(kwargs, groups, bias_group):
    topo = Topology.create(**kwargs)
    plan = plan_shared_reductions(_moe_specs(), topo)
    assert plan.group_names == groups
    edp = plan.reduction("edp")
    assert edp.divisor == topo.dp
    assert set(edp.names) == {"experts.0.fc1.weight", "experts.0.fc2.bias"}
    assert plan.group_of("router.weight") is None and plan.group_of("frozen.expert") is None
    assert plan.group_of("experts.0.fc2.bias") == bias_group
    assert all(r.divisor == 1 for r in plan.reductions if r.group != "edp")
    assert ReductionPlan.from_json(plan.to_json()) == plan
    dense, expert = split_expert_specs(_moe_specs())
    assert [s.name for s in dense] == ["router.weight", "norm.weight"]
    assert len(expert) == 3


def test_plans_without_experts_keep_their_json():
    plan = plan_shared_reductions([ParamSpec(name="n", shape=(4,), replicated_over=("cp",))], TOPO)
    assert all("divisor" not in r for r in plan.to_json()["reductions"])
    assert "expert" not in ParamSpec(name="n", shape=(4,)).to_json()
    spec = ParamSpec.from_json({"name": "w", "shape": [2], "expert": True})
    assert spec.expert and ParamSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError, match="'expert' must be true or false, got 'yes'"):
        ParamSpec.from_json({"name": "w", "shape": [2], "expert": "yes"})


def test_cli_plans_expert_owners_over_edp(tmp_path, capsys) -> None:
    """``gradsync plan`` with expert parameters: dense buckets and owners over dp, expert
    owners over edp (a second shard table); without experts the JSON has no expert key."""
    from gradsync_core import BucketPlan, ShardPlan
    from gradsync_core.cli._main import main

    entries = [
        {"name": "router", "shape": [8, 4]},
        {"name": "experts.w_in", "shape": [2, 8, 16], "expert": True},
        {"name": "experts.w_out", "shape": [2, 16, 8], "expert": True},
        {"name": "head", "shape": [8, 8]},
    ]
    path = tmp_path / "params.json"
    path.write_text(json.dumps(entries))
    argv = ["plan", "--params", str(path), "--world-size", "16", "--tp", "2", "--ep", "4"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {s.name for s in BucketPlan.from_json(out["buckets"]).slots} == {"router", "head"}
    assert ShardPlan.from_json(out["shards"]).world_size == 8  # dense dp = 16 / tp
    expert = ShardPlan.from_json(out["expert_shards"])
    assert expert.world_size == 2  # edp = 16 / (etp 2 * ep 4)
    assert {s.name for s in expert.shards} == {"experts.w_in", "experts.w_out"}
    assert "expert_shards" in out["fingerprints"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "over 2 expert data-parallel (edp) ranks" in text
    assert "edp rank" in text
    path.write_text(json.dumps([{k: v for k, v in e.items() if k != "expert"} for e in entries]))
    assert main([*argv, "--json"]) == 0
    assert "expert_shards" not in json.loads(capsys.readouterr().out)
