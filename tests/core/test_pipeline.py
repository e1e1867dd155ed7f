"""The pipeline plan: action grammar, partition, placement, schedules' refusals, JSON and CSV,
and the validator's refusals (docs/pipeline.md). The orders themselves are compared with
torch's in tests/torch/test_pipeline_orders.py."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    SCHEDULES,
    Action,
    PipelinePlan,
    Topology,
    builtin_model,
    check_actions,
    parse_layout,
    partition_layers,
    plan_pipeline,
    simulate_pipeline,
)
from gradsync_core.plan.pipeline._schedules import stage_ranks

# (schedule, pp, microbatches, stages per rank): one accepted case of each schedule.
EXAMPLES = [
    ("GPipe", 4, 3, 1),
    ("1F1B", 4, 6, 1),
    ("Interleaved1F1B", 4, 8, 2),
    ("LoopedBFS", 2, 5, 3),
    ("InterleavedZeroBubble", 3, 6, 2),
    ("ZBVZeroBubble", 4, 5, 2),
    ("DualPipeV", 2, 6, 2),
]


def plan_of(schedule, pp, m, v, **kwargs):
    kwargs.setdefault("layers", 2 * pp * v)
    return plan_pipeline(
        schedule=schedule, microbatches=m, topology=Topology(pp=pp), stages_per_rank=v, **kwargs
    )


# ---- the grammar -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "2F0",
        "0B13",
        "1I2",
        "1W2",
        "1SEND_F3",
        "2RECV_F3",
        "3SEND_B0",
        "2RECV_B0",
        "0UNSHARD",
        "0RESHARD",
        "12REDUCE_GRAD",
        "(0F3;3B1)OVERLAP_F_B",
        "(7F4;0I2)OVERLAP_F_B",
    ],
)
def test_actions_read_and_write_torchs_spelling(text):
    assert str(Action.parse(text)) == text


@pytest.mark.parametrize(
    "text",
    [
        "",
        "F0",
        "0X1",
        "0F1x",
        "0F",
        "0REDUCE_GRAD1",
        "(0F1)OVERLAP_F_B",
        "(0B1;1F0)OVERLAP_F_B",
        "0OVERLAP_F_B",
    ],
)
def test_malformed_actions_are_refused(text):
    with pytest.raises(ValueError):
        Action.parse(text)


# ---- partition and placement -------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "stages", "weights", "expected"),
    [
        # torchtitan's generate_llm_fqn_per_model_part, worked by hand
        (8, 4, (1, 1), ("Ett", "ttt", "tt", "tL")),
        (12, 4, (1, 1), ("Ettt", "tttt", "ttt", "ttL")),
        (3, 2, (2, 2), ("Ett", "tL")),
        (6, 8, (1, 1), ("E", "t", "t", "t", "t", "t", "t", "L")),
        (5, 1, (3, 3), ("EtttttL",)),
        (4, 2, (0, 0), ("Ett", "ttL")),
    ],
)
def test_layers_spread_with_lighter_first_and_last_stages(layers, stages, weights, expected):
    got = partition_layers(layers, stages, input_weight=weights[0], output_weight=weights[1])
    assert got == expected
    assert "".join(got).count("t") == layers


@pytest.mark.parametrize(
    ("layers", "stages", "weights", "match"),
    [(2, 6, (1, 1), "more than the 4 effective"), (4, 3, (3, 1), "exceeds")],
)
def test_partitions_torchtitan_refuses_are_refused(layers, stages, weights, match):
    with pytest.raises(ValueError, match=match):
        partition_layers(layers, stages, input_weight=weights[0], output_weight=weights[1])


def test_megatron_layouts_are_read():
    assert parse_layout("E|t*3|t*3|tL") == ("E", "ttt", "ttt", "tL")
    assert parse_layout("Ettt|(tt|)*3,m|L") == ("Ettt", "tt", "tt", "tt", "m", "L")
    plan = plan_of("1F1B", 4, 4, 1, layers=None, layout="E|t*3|t*3|tL")
    assert plan.layout == "E|t*3|t*3|tL"
    assert [s.modules for s in plan.stages][-1] == ("layers.6", "loss")


@pytest.mark.parametrize(
    ("layout", "match"),
    [
        ("Et|x|L", "'x' in stage 1"),
        ("Et||tL", "stage 1 .* is empty"),
        ("t|tL", "start with"),
        ("Et|tL|L", "end with the loss"),
        ("E|" + "t*70000|L", "more than 65,536"),
    ],
)
def test_bad_layouts_are_refused(layout, match):
    with pytest.raises(ValueError, match=match):
        parse_layout(layout)


def test_a_layout_must_fill_pp_times_virtual_stages():
    with pytest.raises(ValueError, match="has 3 stages"):
        plan_pipeline(schedule="1F1B", microbatches=4, topology=Topology(pp=2), layout="Et|t|tL")


def test_gpt2_blocks_are_cut_in_order_with_the_embedding_first_and_the_norm_last():
    specs = builtin_model("gpt2-small")
    plan = plan_of("Interleaved1F1B", 2, 4, 2, layers=None, specs=specs)
    modules = [name for stage in plan.stages for name in stage.modules]
    blocks = [f"transformer.h.{i}" for i in range(12)]
    assert modules == ["transformer.wte", "transformer.wpe", *blocks, "transformer.ln_f"]
    assert plan.layout == "Et*3|t*4|t*3|t*2L"


def test_a_parameter_between_blocks_is_refused():
    from gradsync_core import ParamSpec

    names = ["emb.weight", "h.0.w", "mid.w", "h.1.w", "head.w"]
    specs = [ParamSpec(name=n, shape=(2,)) for n in names]
    with pytest.raises(ValueError, match=r"'mid\.w' sits between blocks 'h\.0' and 'h\.1'"):
        plan_of("GPipe", 2, 2, 1, layers=None, specs=specs)


@pytest.mark.parametrize(("pp", "v"), [(2, 2), (4, 2), (3, 4)])
def test_loop_and_v_placement_give_every_rank_v_stages(pp, v):
    loop, vee = stage_ranks(pp, pp * v, "loop"), stage_ranks(pp, pp * v, "v")
    for ranks in (loop, vee):
        assert sorted(ranks) == sorted(list(range(pp)) * v)
    assert loop[:pp] == vee[:pp] == tuple(range(pp))
    if v == 2:
        assert vee[pp:] == tuple(reversed(range(pp)))  # the V: rank 0 holds first and last


def test_global_ranks_follow_the_topologys_pipeline_groups():
    topo = Topology.create(world_size=16, tp=2, pp=4)
    plan = plan_pipeline(schedule="ZBV", microbatches=4, topology=topo, layers=8)
    groups = topo.groups("pp")
    for stage in plan.stages:
        assert plan.global_ranks(stage.index) == tuple(g[stage.rank] for g in groups)
    for rank in range(16):
        assert plan.actions_for(rank) == plan.actions[topo.group_rank("pp", rank)]


# ---- schedules: torch's refusals ---------------------------------------------------------


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "v", "match"),
    [
        ("1F1B", 4, 3, 1, "at least as many microbatches as stages"),
        ("Interleaved1F1B", 4, 9, 2, "multiple of the number of rounds"),
        ("InterleavedZeroBubble", 3, 7, 2, "multiple of the number of rounds"),
        ("ZBVZeroBubble", 2, 4, 3, "exactly 2 stages per rank"),
        ("DualPipeV", 2, 4, 1, "exactly 2 stages per rank"),
        ("DualPipeV", 4, 7, 2, "at least as many microbatches as stages"),
        ("GPipe", 2, 4, 2, "one stage per rank"),
        ("PipeDream", 2, 4, 1, "unknown schedule"),
    ],
)
def test_combinations_torch_refuses_are_refused(schedule, pp, m, v, match):
    with pytest.raises(ValueError, match=match):
        plan_of(schedule, pp, m, v)


def test_schedule_names_are_torchs_in_any_case_and_the_papers():
    assert plan_of("zb1p", 2, 4, 2).schedule == "InterleavedZeroBubble"
    assert plan_of("ZBV", 2, 4, 2).schedule == "ZBVZeroBubble"
    assert plan_of("gpipe", 2, 4, 1).schedule == "GPipe"


# ---- the plan as a value ------------------------------------------------------------------


@pytest.mark.parametrize("zero3", [False, True], ids=["plain", "zero3"])
@pytest.mark.parametrize("case", EXAMPLES, ids=lambda c: c[0])
def test_json_round_trip_is_identity(case, zero3):
    plan = plan_of(*case, zero3=zero3)
    again = PipelinePlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.fingerprint == plan.fingerprint
    assert plan.stages_per_rank == case[3] and plan.pp == case[1]
    assert any(a.kind == "UNSHARD" for row in plan.actions for a in row) == zero3


@pytest.mark.parametrize("case", EXAMPLES, ids=lambda c: c[0])
def test_csv_round_trip_keeps_every_action(case):
    plan = plan_of(*case, zero3=True)
    topo = Topology(pp=case[1])
    full = PipelinePlan.from_csv(plan.to_csv(), topology=topo, format="compute_comms")
    assert full.actions == plan.actions and full.zero3 and full.schedule == "custom"
    only = PipelinePlan.from_csv(plan.to_csv("compute_only"), topology=topo, zero3=True)
    assert only.actions == plan.actions and only.stage_ranks == plan.stage_ranks
    assert only.placement == plan.placement


def test_csv_with_communication_must_be_read_as_compute_comms():
    text = plan_of("GPipe", 2, 2, 1).to_csv()
    with pytest.raises(ValueError, match="format='compute_comms'"):
        PipelinePlan.from_csv(text, topology=Topology(pp=2))


def test_csv_rows_must_match_pp_and_stages_one_rank():
    text = plan_of("GPipe", 2, 2, 1).to_csv("compute_only")
    with pytest.raises(ValueError, match="2 rows but pp = 4"):
        PipelinePlan.from_csv(text, topology=Topology(pp=4))
    with pytest.raises(ValueError, match="stage 0 has actions on rank 0 and rank 1"):
        PipelinePlan.from_csv("0F0,0B0\n0F1,0B1,1F0,1B0,1F1,1B1\n", topology=Topology(pp=2))


def test_a_compute_order_that_cannot_be_lowered_is_refused():
    with pytest.raises(ValueError, match="cannot be lowered"):
        PipelinePlan.from_csv("0B0,0F0\n1F0,1B0\n", topology=Topology(pp=2))


@pytest.mark.parametrize(
    ("schedule", "pp", "m", "expected"),
    [
        ("GPipe", 4, 6, (6, 6, 6, 6)),  # every forward before any backward
        ("1F1B", 4, 6, (4, 3, 2, 1)),  # p - r in flight (torch warms up p - r forwards)
        ("1F1B", 4, 4, (4, 3, 2, 1)),
    ],
)
def test_peak_stash_is_the_schedules(schedule, pp, m, expected):
    assert plan_of(schedule, pp, m, 1).peak_stash == expected


# ---- the validator -------------------------------------------------------------------------


def mutated(plan, rank, edit):
    obj = plan.to_json()
    obj["actions"][rank] = edit(list(obj["actions"][rank]))
    return obj


def swap(row, a, b):
    i, j = row.index(a), row.index(b)
    row[i], row[j] = row[j], row[i]
    return row


@pytest.mark.parametrize(
    ("rank", "edit", "match"),
    [
        (0, lambda r: swap(r, "0F0", "0B0"), "runs 0B0 before the forward 0F0"),
        (1, lambda r: [a for a in r if a != "1RECV_F0"], "without receiving its input first"),
        (0, lambda r: [a for a in r if a != "0REDUCE_GRAD"], "never reduces its gradients"),
        (0, lambda r: swap(r, "0REDUCE_GRAD", "0B1"), "after 1 of 2 backwards"),
        (1, lambda r: [*r, "1REDUCE_GRAD"], "reduces the gradients of stage 1 twice"),
        (0, lambda r: ["0UNSHARD", *r], "does not shard parameters"),
        (1, lambda r: [a.replace("1F1", "0F1") for a in r], "stage 0 runs on rank 0"),
        (0, lambda r: [*r, "0F2"], "the step runs 2 microbatches"),
        (0, lambda r: [a for a in r if a not in ("0B1", "0REDUCE_GRAD")], "no backward of mi"),
        (1, lambda r: swap(r, "1RECV_F0", "1RECV_F1"), "without receiving|another order"),
    ],
)
def test_the_validator_refuses_broken_plans(rank, edit, match):
    plan = plan_of("GPipe", 2, 2, 1)
    with pytest.raises(ValueError, match=match):
        PipelinePlan.from_json(mutated(plan, rank, edit))


def test_receives_posted_out_of_the_senders_order_are_refused():
    # Both receives are posted before either forward, in the reverse of the sends' order:
    # point-to-point messages match in order, so the data would land in the wrong buffers.
    rows = [
        [
            "0F0",
            "0SEND_F0",
            "0F1",
            "0SEND_F1",
            "0RECV_B0",
            "0B0",
            "0RECV_B1",
            "0B1",
            "0REDUCE_GRAD",
        ],
        [
            "1RECV_F1",
            "1RECV_F0",
            "1F0",
            "1B0",
            "1SEND_B0",
            "1F1",
            "1B1",
            "1SEND_B1",
            "1REDUCE_GRAD",
        ],
    ]
    actions = [[Action.parse(a) for a in row] for row in rows]
    with pytest.raises(ValueError, match="rank 0 sends to rank 1 in another order"):
        check_actions(actions, (0, 1), 2, zero3=False)


def test_a_deadlock_is_refused_naming_each_wait():
    rows = [
        ["0F0", "0RECV_B0", "0B0", "0SEND_F0", "0REDUCE_GRAD"],
        ["1RECV_F0", "1F0", "1B0", "1SEND_B0", "1REDUCE_GRAD"],
    ]
    actions = [[Action.parse(a) for a in row] for row in rows]
    with pytest.raises(
        ValueError,
        match=r"deadlock: rank 0 waits at 0B0 for 1SEND_B0 on rank 1; "
        r"rank 1 waits at 1F0 for 0SEND_F0 on rank 0",
    ):
        check_actions(actions, (0, 1), 1, zero3=False)


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        (lambda r: swap(r, "0I0", "0W0"), "before the input gradient 0I0"),
        (lambda r: [a for a in r if a not in ("0W1", "0REDUCE_GRAD")], "weight gradient 0W1"),
    ],
)
def test_weight_gradients_come_after_their_input_gradients(edit, match):
    plan = plan_of("ZB1P", 2, 2, 1)
    with pytest.raises(ValueError, match=match):
        PipelinePlan.from_json(mutated(plan, 0, edit))


def test_zero3_computes_only_unsharded_stages():
    plan = plan_of("GPipe", 2, 2, 1, zero3=True)
    with pytest.raises(ValueError, match="while stage 0 is sharded"):
        PipelinePlan.from_json(mutated(plan, 0, lambda r: [a for a in r if a != "0UNSHARD"]))
    with pytest.raises(ValueError, match="end the step unsharded"):
        PipelinePlan.from_json(mutated(plan, 0, lambda r: [a for a in r if a != "0RESHARD"]))


def test_every_schedule_is_planned():
    assert {plan_of(*case).schedule for case in EXAMPLES} == set(SCHEDULES)


def test_a_placement_that_does_not_match_the_ranks_is_refused():
    obj = plan_of("ZBV", 2, 4, 2).to_json()
    obj["placement"] = "loop"
    with pytest.raises(ValueError, match="placement 'loop' does not match"):
        PipelinePlan.from_json(obj)


def test_ranks_holding_different_numbers_of_stages_are_refused():
    text = "0F0,1F0,1B0,0B0\n2F0,2B0\n"
    with pytest.raises(ValueError, match=r"pipeline ranks hold \[2, 1\] stages"):
        PipelinePlan.from_csv(text, topology=Topology(pp=2))


@settings(max_examples=60, deadline=None)
@given(
    schedule=st.sampled_from(SCHEDULES),
    pp=st.integers(1, 5),
    m=st.integers(1, 10),
    v=st.integers(1, 3),
    zero3=st.booleans(),
)
def test_any_accepted_plan_round_trips_and_does_all_its_work(schedule, pp, m, v, zero3):
    try:
        plan = plan_of(schedule, pp, m, v, zero3=zero3)
    except ValueError:
        return  # a combination torch refuses (the tables above name each rule)
    assert PipelinePlan.from_json(json.loads(json.dumps(plan.to_json()))) == plan
    again = PipelinePlan.from_csv(plan.to_csv("compute_only"), topology=plan.topology, zero3=zero3)
    assert again.actions == plan.actions
    sim = simulate_pipeline(plan, forward=1, backward=3, weight=1)
    assert sim.busy == (v * m * 4,) * pp  # every stage of the rank, every microbatch, once
    assert max(sim.peak_stash) <= v * m and sim.peak_stash == plan.peak_stash
