"""Parameter-shard plans (ZeRO-3, FSDP2's dim-0 cut) and the per-rank memory estimates
(docs/design.md §16). Checked against FSDP2 itself in tests/torch/test_param_shard_plan_fsdp.py."""

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    ParamShardPlan,
    ParamSpec,
    block_prefixes,
    builtin_model,
    chunk_rows,
    estimate_ddp,
    estimate_zero1,
    estimate_zero2,
    estimate_zero3,
    optimizer_state_bytes,
    plan_buckets,
    plan_flat_shards,
    plan_greedy_shards,
    plan_param_shards,
)


def spec(name, *shape, requires_grad=True, dtype="float32"):
    return ParamSpec(name=name, shape=shape, requires_grad=requires_grad, dtype=dtype)


# (rows, shard_size) -> each rank's (start, stop) and the padded rows every rank stores,
# written out from torch.chunk's documented behaviour (chunks of ceil(d/n), fewer than n
# chunks when d is small: torch.chunk(arange(6), 4) has 3 chunks of 2).
@pytest.mark.parametrize(
    ("rows", "n", "expected", "padded"),
    [
        (8, 4, [(0, 2), (2, 4), (4, 6), (6, 8)], 2),
        (5, 4, [(0, 2), (2, 4), (4, 5), (5, 5)], 2),
        (6, 4, [(0, 2), (2, 4), (4, 6), (6, 6)], 2),
        (1, 3, [(0, 1), (1, 1), (1, 1)], 1),
        (2, 3, [(0, 1), (1, 2), (2, 2)], 1),
        (7, 3, [(0, 3), (3, 6), (6, 7)], 3),
        (0, 2, [(0, 0), (0, 0)], 0),
        (3, 1, [(0, 3)], 3),
    ],
    ids=["even", "short-last", "fewer-chunks", "one-row", "rows<ranks", "odd", "empty", "one-rank"],
)
def test_chunk_rows_table(rows, n, expected, padded):
    got = [chunk_rows(rows, n, r) for r in range(n)]
    assert [(a, b) for a, b, _ in got] == expected
    assert {p for _, _, p in got} == {padded}


def test_chunks_report_local_and_padded_shapes_and_element_ranges():
    plan = plan_param_shards([spec("w", 5, 3)], world_size=4)
    chunks = plan.chunks_of(2)
    assert len(chunks) == 1
    c = chunks[0]
    assert (c.local_shape, c.padded_shape) == ((1, 3), (2, 3))
    assert (c.numel, c.padded_numel, c.padding_numel) == (3, 6, 3)
    assert c.element_range == (12, 15)
    assert plan.chunk("w", 3).local_shape == (0, 3)


GPT_LIKE = [
    spec("wte.weight", 11, 4),
    spec("h.0.ln.weight", 4),
    spec("h.0.attn.weight", 12, 4),
    spec("h.0.mlp.fc.weight", 3, 4),
    spec("h.1.ln.weight", 4, requires_grad=False),
    spec("h.1.attn.weight", 12, 4),
    spec("h.1.mlp.fc.weight", 3, 4),
    spec("ln_f.weight", 4),
]


def test_units_root_first_then_blocks_in_module_order():
    plan = plan_param_shards(GPT_LIKE, world_size=2, units=["h.1", "h.0"])
    assert [u.prefix for u in plan.units] == ["", "h.0", "h.1"]
    assert plan.units[0].params == ("wte.weight", "ln_f.weight")
    assert plan.unit_of("h.1.ln.weight").prefix == "h.1"
    # the order of the prefixes given does not matter: same plan, same fingerprint
    again = plan_param_shards(GPT_LIKE, world_size=2, units=["h.0", "h.1", ""])
    assert again == plan and again.fingerprint == plan.fingerprint


def test_nested_units_give_each_parameter_its_innermost_unit():
    plan = plan_param_shards(GPT_LIKE, world_size=2, units=["h.0", "h.0.mlp", "h.1.mlp.fc"])
    by_prefix = {u.prefix: u.params for u in plan.units}
    assert by_prefix["h.0"] == ("h.0.ln.weight", "h.0.attn.weight")
    assert by_prefix["h.0.mlp"] == ("h.0.mlp.fc.weight",)
    assert by_prefix["h.1.mlp.fc"] == ("h.1.mlp.fc.weight",)
    assert "h.1.attn.weight" in by_prefix[""]
    # outer block before its inner one, both in module order
    assert [u.prefix for u in plan.units] == ["", "h.0", "h.0.mlp", "h.1.mlp.fc"]


def test_members_follow_fsdp2s_children_first_walk():
    # A module's own parameters come after its children's, as FSDP2's _get_managed_modules
    # appends a module after visiting its children; named_parameters() lists them first.
    specs = [spec("bias", 4), spec("a.weight", 4), spec("a.b.weight", 2), spec("c.weight", 3)]
    plan = plan_param_shards(specs, world_size=2)
    assert plan.units[0].params == ("a.b.weight", "a.weight", "c.weight", "bias")
    assert [p.name for p in plan.params] == [s.name for s in specs]  # params keep spec order


def test_hsdp_cuts_over_the_shard_group_only():
    plan = plan_param_shards(GPT_LIKE, world_size=8, dp_shard=4)
    assert (plan.shard_size, plan.replicate_size, plan.world_size) == (4, 2, 8)
    assert plan.chunk("wte.weight", 3).local_shape == (2, 4)  # 11 rows over 4: 3, 3, 3, 2
    with pytest.raises(ValueError, match="shard_rank must be in"):
        plan.chunk("wte.weight", 4)


@pytest.mark.parametrize(
    ("specs", "kwargs", "error", "message"),
    [
        ([spec("s")], {}, ValueError, "scalar .0-d., which FSDP2 refuses"),
        (GPT_LIKE, {"units": ["h.7"]}, ValueError, "'h.7' matches no parameter"),
        (GPT_LIKE, {"units": ["h"]}, None, None),
        (GPT_LIKE, {"units": ["h.0.ln.weight"]}, ValueError, "names a parameter, not a module"),
        (GPT_LIKE, {"units": ["h.0", "h.0"]}, ValueError, "listed twice"),
        (GPT_LIKE, {"units": "h.0"}, TypeError, "not the string"),
        (GPT_LIKE, {"units": [3]}, TypeError, "must be a string"),
        (GPT_LIKE, {"dp_shard": 3}, ValueError, "does not divide world_size 4"),
        (GPT_LIKE, {"world_size": 0}, ValueError, "world_size must be a positive int"),
        ([spec("a", 2), spec("a", 3)], {}, ValueError, "appears twice"),
    ],
    ids=[
        "scalar",
        "unknown-prefix",
        "outer-prefix-ok",
        "param-not-module",
        "duplicate",
        "string-units",
        "non-string",
        "hsdp-divide",
        "world-size",
        "duplicate-names",
    ],
)
def test_bad_input_is_one_sentence(specs, kwargs, error, message):
    kwargs = {"world_size": 4} | kwargs
    if error is None:
        plan_param_shards(specs, **kwargs)
        return
    with pytest.raises(error, match=message) as info:
        plan_param_shards(specs, **kwargs)
    assert "\n" not in str(info.value)


def test_block_prefixes_of_the_builtin_models():
    assert block_prefixes(builtin_model("gpt2-small"))[:2] == ["transformer.h.0", "transformer.h.1"]
    assert len(block_prefixes(builtin_model("gpt2-small"))) == 12
    assert block_prefixes(builtin_model("mlp-25m"))[-1] == "layers.23"
    resnet = block_prefixes(builtin_model("resnet50"))
    assert resnet[:2] == ["layer1.0", "layer1.1"] and len(resnet) == 16  # no downsample.0


def test_json_is_versioned_named_and_refuses_other_kinds():
    plan = plan_param_shards(GPT_LIKE, world_size=3, units=["h.0", "h.1"])
    obj = json.loads(json.dumps(plan.to_json()))
    assert obj["version"] == 1 and obj["kind"] == "param_shard_plan"
    assert obj["params"][0] == {
        "name": "wte.weight",
        "shape": [11, 4],
        "dtype": "float32",
        "requires_grad": True,
        "unit": 0,
    }
    with pytest.raises(ValueError, match="expected a 'param_shard_plan' plan"):
        ParamShardPlan.from_json(obj | {"kind": "shard_plan"})
    with pytest.raises(ValueError, match="version"):
        ParamShardPlan.from_json(obj | {"version": 99})
    with pytest.raises(ValueError, match="rule"):
        ParamShardPlan.from_json(obj | {"rule": "dim1"})
    moved = json.loads(json.dumps(obj))
    moved["units"][1]["params"].append("wte.weight")  # a parameter in two units
    with pytest.raises(ValueError, match="exactly one unit"):
        ParamShardPlan.from_json(moved)


def test_fingerprint_is_pinned():
    # A change to the plan's JSON or rule changes this string: bump PLAN_VERSION with it,
    # since torch and JAX executors compare fingerprints across versions of gradsync.
    plan = plan_param_shards(GPT_LIKE, world_size=2, units=["h.0", "h.1"])
    assert (
        plan.fingerprint
        == plan_param_shards(list(GPT_LIKE), world_size=2, units=("h.1", "h.0")).fingerprint
    )
    assert plan.fingerprint != plan_param_shards(GPT_LIKE, world_size=3, units=["h.0"]).fingerprint
    assert plan.fingerprint == PINNED


PINNED = "b0be51dba2565f22b0afe44a89227965cebc76cfe950a63dc5a3022fc4c256e6"


def test_renamed_changes_labels_only():
    plan = plan_param_shards(GPT_LIKE, world_size=2, units=["h.0", "h.1"])
    names = {p.name: "params/" + p.name.replace(".", "/") for p in plan.params}
    flax = plan.renamed(names, prefixes={"h.0": "params/h_0"})
    assert flax.units[1].prefix == "params/h_0" and flax.units[2].prefix == "h.1"
    assert flax.chunk("params/wte/weight", 1).local_shape == plan.chunk("wte.weight", 1).local_shape
    back = flax.renamed({v: k for k, v in names.items()}, prefixes={"params/h_0": "h.0"})
    assert back == plan and back.fingerprint == plan.fingerprint
    with pytest.raises(ValueError, match="missing"):
        plan.renamed({})
    with pytest.raises(ValueError, match="two parameters to one name"):
        plan.renamed(dict.fromkeys(names, "x"))


shapes = st.lists(
    st.tuples(st.integers(0, 40), st.integers(1, 3), st.booleans()), min_size=1, max_size=8
)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, world_size=st.integers(1, 9), blocks=st.integers(0, 3))
def test_every_element_is_held_by_exactly_one_rank(shapes, world_size, blocks):
    specs = [
        spec(f"b.{i % max(blocks, 1)}.p{i}", d, k, requires_grad=g)
        for i, (d, k, g) in enumerate(shapes)
    ]
    units = [f"b.{j}" for j in range(blocks) if any(s.name.startswith(f"b.{j}.") for s in specs)]
    plan = plan_param_shards(specs, world_size=world_size, units=units)
    for s in specs:
        covered = []
        padded = {plan.chunk(s.name, r).padded_rows for r in range(world_size)}
        assert padded == {math.ceil(s.shape[0] / world_size)}  # every rank stores the same
        for r in range(world_size):
            c = plan.chunk(s.name, r)
            covered.extend(range(*c.element_range))
            assert c.padded_numel == c.numel + c.padding_numel
        assert covered == list(range(s.numel))  # in rank order, no gap, no overlap
        total_padding = sum(plan.chunk(s.name, r).padding_numel for r in range(world_size))
        d = s.shape[0]
        assert total_padding == (world_size * math.ceil(d / world_size) - d) * s.shape[1]
    members = sorted(name for u in plan.units for name in u.params)
    assert members == sorted(s.name for s in specs)  # each parameter in exactly one unit
    again = ParamShardPlan.from_json(json.loads(json.dumps(plan.to_json())))
    assert again == plan and again.fingerprint == plan.fingerprint


# --- memory estimates ---------------------------------------------------------------


def test_optimizer_state_bytes():
    assert optimizer_state_bytes("adam") == 8 and optimizer_state_bytes("sgd") == 0
    assert optimizer_state_bytes(12) == 12
    with pytest.raises(ValueError, match="unknown optimizer 'shampoo'"):
        optimizer_state_bytes("shampoo")


MLP = [spec(f"layers.{i}.weight", 10, 6) for i in range(4)] + [spec("head.weight", 3, 6)]


def test_ddp_and_zero1_keep_whole_replicas():
    buckets = plan_buckets(MLP)
    total = sum(s.nbytes for s in MLP)
    ddp = estimate_ddp(MLP, buckets, world_size=2)
    assert [r.rank for r in ddp.ranks] == [0, 1]
    r0 = ddp.ranks[0]
    assert (r0.parameter_bytes, r0.gradient_bytes, r0.optimizer_state_bytes) == (
        total,
        total,
        2 * total,
    )
    assert r0.transient_bytes == buckets.nbytes == total
    assert r0.peak_bytes == 5 * total
    shards = plan_greedy_shards(MLP, world_size=2)
    z1 = estimate_zero1(MLP, buckets, shards)
    assert [r.optimizer_state_bytes for r in z1.ranks] == [8 * n for n in shards.rank_numel]
    assert z1.ranks[0].parameter_bytes == total


def test_zero2_shards_gradients_by_bucket_chunks():
    buckets = plan_buckets(MLP, pad_to=4)
    z2 = estimate_zero2(MLP, plan_flat_shards(buckets, world_size=4))
    assert z2.ranks[0].gradient_bytes == buckets.nbytes // 4
    assert z2.ranks[0].transient_bytes == 2 * max(b.nbytes for b in buckets.buckets)
    with pytest.raises(ValueError, match="flat ShardPlan"):
        estimate_zero2(MLP, plan_greedy_shards(MLP, world_size=4))


def test_zero3_formula_by_hand():
    # 4 blocks of (10, 6) and a root head (3, 6) over 4 ranks: chunks of 3 and 1 rows.
    plan = plan_param_shards(MLP, world_size=4, units=[f"layers.{i}" for i in range(4)])
    z3 = estimate_zero3(plan)
    block_local = 3 * 6 * 4  # 3 padded rows of 6 fp32
    root_local = 1 * 6 * 4
    r = z3.ranks[3]
    assert r.parameter_bytes == r.gradient_bytes == 4 * block_local + root_local
    # rank 3 holds rows 9..10 of each block (1 row) and no row of the 3-row head
    assert r.optimizer_state_bytes == 8 * (4 * 1 * 6)
    assert z3.ranks[0].optimizer_state_bytes == 8 * (4 * 3 * 6 + 6)
    # root gathered + two blocks (prefetch) + the worst unit's backward: its unsharded
    # gradients and the reduce-scatter input, less its own sharded gradients
    block_gathered, root_gathered = 4 * block_local, 4 * root_local
    backward = 2 * block_gathered - block_local
    assert r.transient_bytes == root_gathered + 2 * block_gathered + backward
    assert estimate_zero3(plan, prefetch=0).ranks[0].transient_bytes == (
        root_gathered + block_gathered + backward
    )
    kept = estimate_zero3(plan, reshard_after_forward=False).ranks[0].transient_bytes
    assert kept == root_gathered + 4 * block_gathered + backward
    bf16 = estimate_zero3(plan, param_dtype="bfloat16").ranks[0].transient_bytes
    assert bf16 == (root_gathered + 2 * block_gathered) // 2 + block_gathered - block_local
    fp32_reduce = estimate_zero3(plan, param_dtype="bfloat16", reduce_dtype="float32")
    assert fp32_reduce.ranks[0].transient_bytes == bf16 + block_gathered // 2
    # a tied weight's gradient is accumulated: two more copies instead of the reduce input
    tied = estimate_zero3(plan, tied=["layers.0.weight"]).ranks[0].transient_bytes
    assert tied == r.transient_bytes + block_gathered
    with pytest.raises(ValueError, match="tied parameter 'wte' is not in the plan"):
        estimate_zero3(plan, tied=["wte"])
    assert z3.max.rank == 0
    assert json.loads(json.dumps(z3.to_json()))["max_rank"]["peak_bytes"] == z3.max.peak_bytes


def test_zero3_frozen_parameters_have_no_gradient_or_state():
    specs = [spec("a", 4, 2), spec("f", 4, 2, requires_grad=False)]
    z3 = estimate_zero3(plan_param_shards(specs, world_size=2))
    r = z3.ranks[0]
    assert (r.parameter_bytes, r.gradient_bytes, r.optimizer_state_bytes) == (32, 16, 32)


def test_zero3_hsdp_lists_shard_ranks():
    plan = plan_param_shards(MLP, world_size=8, dp_shard=4)
    z3 = estimate_zero3(plan)
    assert len(z3.ranks) == 4 and (z3.world_size, z3.replicate_size) == (8, 2)


def test_replicate_size_is_the_deprecated_spelling_of_dp_shard(deprecations):
    """``replicate_size=R`` plans what ``dp_shard=world_size // R`` plans, and warns once."""
    new = plan_param_shards(GPT_LIKE, world_size=8, dp_shard=4)
    assert deprecations.messages == []
    assert plan_param_shards(GPT_LIKE, world_size=8, replicate_size=2) == new
    assert plan_param_shards(GPT_LIKE, world_size=8, replicate_size=2) == new
    assert deprecations.messages == [
        "plan_param_shards(replicate_size=) is deprecated and will be removed: use "
        "plan_param_shards(dp_shard=world_size // replicate_size)"
    ]
    with pytest.raises(ValueError, match="replicate_size 3 does not divide world_size 4"):
        plan_param_shards(GPT_LIKE, world_size=4, replicate_size=3)
    with pytest.raises(TypeError, match="dp_shard= and its deprecated spelling replicate_size="):
        plan_param_shards(GPT_LIKE, world_size=8, replicate_size=2, dp_shard=4)
