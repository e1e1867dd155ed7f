"""Shard partitions: greedy (torch ZeroRedundancyOptimizer's rule) and flat (docs/design.md §4)."""

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import ParamSpec, ShardPlan, plan_buckets, plan_flat_shards, plan_greedy_shards


def spec(name, numel, requires_grad=True):
    return ParamSpec(name=name, shape=(numel,), requires_grad=requires_grad)


def owners(plan):
    return {s.name: s.rank for s in plan.shards}


@pytest.mark.parametrize(
    ("numels", "world_size", "expected"),
    [
        # largest first to the least-loaded rank; ties go to the lowest rank
        ((5, 3, 3), 2, [0, 1, 1]),
        ((1, 2, 3, 4), 2, [0, 1, 1, 0]),
        # equal sizes keep registration order (stable sort), round-robin over ranks
        ((4, 4, 4, 4), 3, [0, 1, 2, 0]),
        ((7,), 4, [0]),
    ],
    ids=["basic", "interleave", "stable-ties", "fewer-params-than-ranks"],
)
def test_greedy_table(numels, world_size, expected):
    specs = [spec(f"p{i}", n) for i, n in enumerate(numels)]
    plan = plan_greedy_shards(specs, world_size=world_size)
    assert [plan.owner(f"p{i}") for i in range(len(numels))] == expected


def test_greedy_running_totals_carry_across_param_groups():
    groups = [[spec("a", 10)], [spec("b", 4), spec("c", 3)]]
    plan = plan_greedy_shards(groups, world_size=2)
    assert owners(plan) == {"a": 0, "b": 1, "c": 1}
    assert [s.group for s in plan.shards] == [0, 1, 1]
    assert plan.rank_numel == (10, 7)
    assert plan.imbalance == pytest.approx(10 / 8.5 - 1)


def test_greedy_skips_frozen_parameters():
    plan = plan_greedy_shards([spec("a", 4), spec("f", 100, False)], world_size=2)
    assert owners(plan) == {"a": 0}
    with pytest.raises(KeyError):
        plan.owner("f")


def test_flat_cuts_every_bucket_into_equal_chunks():
    specs = [spec("a", 3), spec("b", 5)]
    buckets = plan_buckets(specs, pad_to=4)  # one bucket [a, b], 8 elements
    plan = plan_flat_shards(buckets, world_size=4)
    assert [(s.name, s.rank, s.start, s.stop) for s in plan.shards] == [
        ("a", 0, 0, 2),
        ("a", 1, 2, 3),
        ("b", 1, 0, 1),
        ("b", 2, 1, 3),
        ("b", 3, 3, 5),
    ]
    assert plan.rank_numel == (2, 2, 2, 2)
    assert plan.padding_numel == 0
    with pytest.raises(ValueError, match="owner\\(\\) needs a greedy plan"):
        plan.owner("a")


def test_flat_needs_buckets_padded_to_the_world_size():
    buckets = plan_buckets([spec("a", 3)])
    with pytest.raises(
        ValueError, match="not a multiple of world_size 2; plan the buckets with pad_to=2"
    ):
        plan_flat_shards(buckets, world_size=2)


@pytest.mark.parametrize("bad", [0, -2, 2.0])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_greedy_shards([spec("a", 1)], world_size=bad)


sizes = st.lists(st.integers(0, 500), min_size=1, max_size=60)


@settings(max_examples=200, deadline=None)
@given(numels=sizes, world_size=st.integers(1, 9))
def test_greedy_properties(numels, world_size):
    specs = [spec(f"p{i}", n) for i, n in enumerate(numels)]
    plan = plan_greedy_shards(specs, world_size=world_size)
    # every trainable parameter in exactly one shard, whole
    assert sorted(s.name for s in plan.shards) == sorted(s.name for s in specs)
    assert all(
        s.start == 0 and s.stop == n
        for s, n in zip(sorted(plan.shards, key=lambda s: int(s.name[1:])), numels, strict=True)
    )
    # the greedy bound: no rank exceeds the ideal load by more than the largest tensor
    assert max(plan.rank_numel) <= sum(numels) / world_size + max(numels)
    assert ShardPlan.from_json(plan.to_json()) == plan


@settings(max_examples=200, deadline=None)
@given(numels=sizes, world_size=st.integers(1, 9), cap=st.integers(4, 2000))
def test_flat_properties(numels, world_size, cap):
    specs = [spec(f"p{i}", n) for i, n in enumerate(numels)]
    buckets = plan_buckets(specs, cap_bytes=cap, pad_to=world_size)
    plan = plan_flat_shards(buckets, world_size=world_size)
    # the pieces of every parameter tile it exactly once
    for s in specs:
        pieces = sorted((p.start, p.stop) for p in plan.shards if p.name == s.name)
        assert pieces, s.name
        assert pieces[0][0] == 0 and pieces[-1][1] == s.numel
        assert all(a[1] == b[0] for a, b in itertools.pairwise(pieces))
    # each rank holds the same number of elements per bucket, padding included
    assert sum(plan.rank_numel) + plan.padding_numel == buckets.numel
    assert plan.padding_numel <= (world_size - 1) * len(buckets.buckets)
    assert ShardPlan.from_json(plan.to_json()) == plan


def test_renamed_renames_shards_and_the_bucket_slots_they_cut():
    specs = [ParamSpec(name="k", shape=(3, 2)), spec("b", 2)]
    plan = plan_flat_shards(plan_buckets(specs, pad_to=4), world_size=4)
    renamed = plan.renamed({"k": "w", "b": "bias"}, {"k": 1}, shapes={"k": (2, 3)})
    assert [(s.name, s.group) for s in renamed.shards] == [
        (("w" if s.name == "k" else "bias"), 1 if s.name == "k" else 0) for s in plan.shards
    ]
    assert [(s.name, s.shape, s.offset) for s in renamed.buckets.slots] == [
        ("w", (2, 3), 0),
        ("bias", (2,), 6),
    ]
    assert [(s.start, s.stop, s.rank) for s in renamed.shards] == [
        (s.start, s.stop, s.rank) for s in plan.shards
    ]
    # Renaming back gives the original plan (and fingerprint).
    back = renamed.renamed({"w": "k", "bias": "b"}, {"w": 0}, shapes={"w": (3, 2)})
    assert back == plan and back.fingerprint == plan.fingerprint
    # Names missing from the mapping are kept.
    assert plan.renamed({}) == plan


def test_renamed_refuses_merged_names_and_other_element_counts():
    plan = plan_flat_shards(plan_buckets([spec("a", 3), spec("b", 5)], pad_to=2), world_size=2)
    with pytest.raises(ValueError, match="gives two parameters the name 'x'"):
        plan.renamed({"a": "x", "b": "x"})
    with pytest.raises(ValueError, match=r"slot 'a' has shape \(3,\) \(3 elements\)"):
        plan.renamed({}, shapes={"a": (2, 2)})
    greedy = plan_greedy_shards([spec("a", 3), spec("b", 5)], world_size=2)
    with pytest.raises(ValueError, match="gives two parameters the name 'x'"):
        greedy.renamed({"a": "x", "b": "x"})
