"""Bucket layouts: DDP's assignment, alignment, padding, rebuild, legacy (docs/design.md §3)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    BucketPlan,
    ParamSpec,
    describe_difference,
    plan_buckets,
    plan_legacy_buckets,
    rebuild_buckets,
)

KIB = 1024


def spec(name, numel, dtype="float32", requires_grad=True):
    return ParamSpec(name=name, shape=(numel,), dtype=dtype, requires_grad=requires_grad)


def names(plan):
    return [[s.name for s in b.slots] for b in plan.buckets]


@pytest.mark.parametrize(
    ("numels", "cap", "first", "expected"),
    [
        # 4 x 1 KiB, cap 2 KiB: [a,b] [c,d], reversed so the last-registered go first.
        ((256, 256, 256, 256), 2 * KIB, None, [["c", "d"], ["a", "b"]]),
        # a bucket closes once it is >= its cap: it overflows by its last tensor only.
        ((200, 200, 200, 200), 1 * KIB, None, [["c", "d"], ["a", "b"]]),
        # a tensor larger than the cap closes a bucket by itself.
        ((10, 1000, 10, 10), 1 * KIB, None, [["c", "d"], ["a", "b"]]),
        # the small first cap sizes the bucket of the earliest parameters (reduced last).
        ((64, 64, 256, 256, 256), 2 * KIB, 512, [["e"], ["c", "d"], ["a", "b"]]),
        ((1,), 25 * KIB * KIB, None, [["a"]]),
    ],
    ids=["even", "overflow-by-last", "big-tensor-alone", "first-cap", "single"],
)
def test_ddp_assignment_table(numels, cap, first, expected):
    specs = [spec(chr(ord("a") + i), n) for i, n in enumerate(numels)]
    plan = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first)
    assert names(plan) == expected
    assert plan.order == "registration"


def test_dtypes_are_bucketed_apart_with_their_own_limit_sequence():
    specs = [
        spec("a", 256),
        spec("h1", 256, "bfloat16"),
        spec("b", 256),
        spec("h2", 256, "bfloat16"),
        spec("c", 256),
    ]
    plan = plan_buckets(specs, cap_bytes=1 * KIB, first_cap_bytes=512)
    # float32: a closes alone (>= 512 first cap), then [b] >= 1 KiB, then [c]; bfloat16
    # (512 B each): h1 closes at the first cap, h2 alone at 1 KiB stays open till the end.
    assert names(plan) == [["c"], ["h2"], ["b"], ["h1"], ["a"]]
    assert [b.dtype for b in plan.buckets] == [
        "float32",
        "bfloat16",
        "float32",
        "bfloat16",
        "float32",
    ]


def test_frozen_parameters_get_no_slot():
    specs = [spec("a", 4), spec("frozen", 4, requires_grad=False), spec("b", 4)]
    plan = plan_buckets(specs)
    assert {s.name for s in plan.slots} == {"a", "b"}
    with pytest.raises(KeyError, match="frozen"):
        plan.slot("frozen")


def test_duplicate_names_are_rejected_with_the_fix():
    with pytest.raises(ValueError, match="appears twice; list tied parameters once"):
        plan_buckets([spec("w", 4), spec("w", 4)])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True])
def test_bad_sizes_are_rejected(bad):
    with pytest.raises(ValueError, match="must be a positive int"):
        plan_buckets([spec("a", 4)], cap_bytes=bad)


def test_align_and_pad_to():
    specs = [spec("a", 3), spec("b", 5), spec("c", 1)]
    plan = plan_buckets(specs, align=4, pad_to=8)
    (bucket,) = plan.buckets
    assert [(s.name, s.offset) for s in bucket.slots] == [("a", 0), ("b", 4), ("c", 12)]
    assert bucket.numel == 16 and bucket.used_numel == 9


def test_rebuild_follows_the_observed_ready_order():
    specs = [spec(n, 256) for n in "abcd"]
    plan = plan_buckets(specs, cap_bytes=2 * KIB)
    rebuilt = rebuild_buckets(plan, specs, ["b", "a", "d", "c"])
    assert names(rebuilt) == [["b", "a"], ["d", "c"]]
    assert rebuilt.order == "observed"
    # parameters that produced no gradient are appended in reverse registration order
    assert names(rebuild_buckets(plan, specs, ["c"])) == [["c", "d"], ["b", "a"]]
    with pytest.raises(ValueError, match="not a trainable parameter"):
        rebuild_buckets(plan, specs, ["zz"])
    with pytest.raises(ValueError, match="twice"):
        rebuild_buckets(plan, specs, ["a", "a"])


def test_rebuild_uses_the_first_cap_for_the_first_bucket_walked():
    specs = [spec(n, 256) for n in "abcde"]
    plan = plan_buckets(specs, cap_bytes=2 * KIB, first_cap_bytes=1 * KIB)
    rebuilt = rebuild_buckets(plan, specs, list("edcba"))
    assert names(rebuilt) == [["e"], ["d", "c"], ["b", "a"]]


def test_legacy_layout_never_overflows_its_buffer():
    specs = [spec("a", 10), spec("b", 10), spec("big", 50), spec("c", 15), spec("d", 5)]
    plan = plan_legacy_buckets(specs, max_numel=20)
    assert names(plan) == [["a", "b"], ["big"], ["c", "d"]]
    assert plan.order == "legacy"
    assert all(b.used_numel <= 20 or len(b.slots) == 1 for b in plan.buckets)


def test_default_legacy_buffer_is_2_pow_28_elements():
    plan = plan_legacy_buckets([spec("a", 10)])
    assert plan.buckets[0].limit_bytes == 2**28 * 4


def test_describe_difference_names_the_first_differing_parameter():
    a = plan_buckets([spec("x", 4), spec("y", 4)])
    b = plan_buckets([spec("x", 4), spec("y", 5)])
    assert describe_difference(a, a) == ""
    assert "'y'" in describe_difference(a, b) and "(4,)" in describe_difference(a, b)
    c = plan_buckets([spec("x", 4)])
    assert "1 more trainable parameter(s), starting with 'y'" in describe_difference(a, c)
    d = plan_buckets([spec("x", 4), spec("y", 4)], cap_bytes=8)
    assert describe_difference(a, d).startswith("cap_bytes differs")


# ---- properties -------------------------------------------------------------------------

DTYPES = ["float32", "bfloat16", "float16", "float64"]
param_lists = st.lists(
    st.tuples(
        st.lists(st.integers(0, 40), min_size=0, max_size=3),
        st.sampled_from(DTYPES),
        st.booleans() | st.just(True),
    ),
    min_size=1,
    max_size=40,
).map(
    lambda rows: [
        ParamSpec(name=f"p{i}", shape=tuple(shape), dtype=dtype, requires_grad=rg)
        for i, (shape, dtype, rg) in enumerate(rows)
    ]
)


@settings(max_examples=200, deadline=None)
@given(
    specs=param_lists,
    cap=st.integers(1, 2000),
    first=st.none() | st.integers(1, 2000),
    align=st.integers(1, 16),
    pad_to=st.integers(1, 16),
)
def test_plan_properties(specs, cap, first, align, pad_to):
    plan = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first, align=align, pad_to=pad_to)
    trainable = [s for s in specs if s.requires_grad]
    by_name = {s.name: s for s in specs}
    # every trainable parameter in exactly one bucket, frozen ones in none
    slot_names = [s.name for s in plan.slots]
    assert sorted(slot_names) == sorted(s.name for s in trainable)
    for index, bucket in enumerate(plan.buckets):
        assert bucket.index == index
        assert bucket.numel % pad_to == 0
        assert {by_name[s.name].dtype for s in bucket.slots} == {bucket.dtype}
        end = 0
        for slot in bucket.slots:
            assert slot.bucket == index and slot.offset % align == 0 and slot.offset >= end
            end = slot.offset + slot.numel
        assert end <= bucket.numel < end + pad_to
        # a bucket exceeds its cap only by its last tensor
        sizes = [by_name[s.name].nbytes for s in bucket.slots]
        assert sum(sizes[:-1]) < bucket.limit_bytes
        # registration order inside a bucket
        positions = [int(s.name[1:]) for s in bucket.slots]
        assert positions == sorted(positions)
    # buckets sorted by smallest index, descending: bucket 0 holds the last-registered
    firsts = [int(b.slots[0].name[1:]) for b in plan.buckets]
    assert firsts == sorted(firsts, reverse=True)
    assert BucketPlan.from_json(plan.to_json()) == plan


@settings(max_examples=100, deadline=None)
@given(specs=param_lists, max_numel=st.integers(1, 100))
def test_legacy_properties(specs, max_numel):
    plan = plan_legacy_buckets(specs, max_numel=max_numel)
    assert sorted(s.name for s in plan.slots) == sorted(s.name for s in specs if s.requires_grad)
    for bucket in plan.buckets:
        assert bucket.used_numel <= max_numel or len(bucket.slots) == 1


@settings(max_examples=100, deadline=None)
@given(specs=param_lists, data=st.data())
def test_rebuild_properties(specs, data):
    plan = plan_buckets(specs, cap_bytes=200, first_cap_bytes=64)
    trainable = [s.name for s in specs if s.requires_grad]
    order = data.draw(st.permutations(trainable))
    observed = order[: data.draw(st.integers(0, len(order)))]
    rebuilt = rebuild_buckets(plan, specs, observed)
    assert sorted(s.name for s in rebuilt.slots) == sorted(trainable)
    remaining = [n for n in reversed(trainable) if n not in observed]
    position = {n: i for i, n in enumerate([*observed, *remaining])}
    for bucket in rebuilt.buckets:
        # inside a bucket, the walk order
        walked = [position[s.name] for s in bucket.slots]
        assert walked == sorted(walked)
    # bucket 0 is the first to be complete (its last gradient ready first)
    completion = [position[b.slots[-1].name] for b in rebuilt.buckets]
    assert completion == sorted(completion)
    assert rebuilt.numel == plan.numel


def test_bucket_caps_follow_ddp_convention():
    from gradsync_core import DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES, MIB, bucket_caps

    assert bucket_caps(None) == (DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES) == (25 * MIB, MIB)
    assert bucket_caps(4.0) == (4 * MIB, 4 * MIB)


def test_padded_only_pads_and_concat_reindexes():
    specs = [ParamSpec(name=f"w{i}", shape=(5,)) for i in range(4)]
    plan = plan_buckets(specs, cap_bytes=40)  # two buckets of 10 elements
    padded = plan.padded(4)
    assert padded.pad_to == 4
    assert [b.numel for b in padded.buckets] == [12, 12]
    assert padded.slots == plan.slots
    assert plan.padded(3).padded(2).pad_to == 6  # lcm with the plan's own pad_to
    with pytest.raises(ValueError, match="multiple must be a positive int"):
        plan.padded(0)
    joined = BucketPlan.concat([plan, plan_buckets([ParamSpec(name="x", shape=(3,))])])
    assert [b.index for b in joined.buckets] == [0, 1, 2]
    assert [s.bucket for s in joined.slots] == [0, 0, 1, 1, 2]
    assert joined.cap_bytes == plan.cap_bytes
    with pytest.raises(ValueError, match="at least one bucket plan"):
        BucketPlan.concat([])


def test_check_names_names_the_first_planned_parameter_the_model_lacks():
    plan = plan_buckets([spec("a", 2), spec("b", 3)])
    plan.check_names(["b", "a", "extra"], where="a parameter of this model")
    with pytest.raises(ValueError, match="the bucket plan names 'b', which is not a leaf of g"):
        plan.check_names(["a"], where="a leaf of grads")
