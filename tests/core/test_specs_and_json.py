"""ParamSpec validation, canonical JSON and fingerprints (docs/design.md §2, §8)."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gradsync_core import (
    BucketPlan,
    ParamSpec,
    ShardPlan,
    Topology,
    builtin_model,
    canonical_json,
    plan_buckets,
    plan_flat_shards,
    plan_greedy_shards,
)


def test_spec_sizes_and_json_round_trip():
    s = ParamSpec(name="w", shape=[4, 3], dtype="bfloat16", replicated_over=["tp"])
    assert s.shape == (4, 3) and s.replicated_over == ("tp",)
    assert (s.numel, s.nbytes) == (12, 24)
    assert ParamSpec.from_json(json.loads(json.dumps(s.to_json()))) == s
    assert ParamSpec.from_json({"name": "b", "shape": [2]}) == ParamSpec(name="b", shape=(2,))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "", "shape": (1,)}, "non-empty string name"),
        ({"name": "w", "shape": (2, -1)}, "non-negative int"),
        ({"name": "w", "shape": (2.0,)}, "non-negative int"),
        ({"name": "w", "shape": (2,), "dtype": "float31"}, "unknown dtype 'float31'"),
    ],
)
def test_bad_specs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParamSpec(**kwargs)


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ({"name": "w"}, "needs at least 'name' and 'shape'"),
        ({"name": "w", "shape": 3}, "'shape' must be a list"),
        ({"name": "w", "shape": [3], "colour": "red"}, "unknown keys \\['colour'\\]"),
        (["w", [3]], "must be a JSON object"),
    ],
)
def test_bad_spec_json(obj, message):
    with pytest.raises(ValueError, match=message):
        ParamSpec.from_json(obj)


def test_plans_are_frozen_hashable_values():
    plan = plan_buckets(builtin_model("resnet50"))
    with pytest.raises(AttributeError):
        plan.cap_bytes = 1
    assert hash(plan) == hash(plan_buckets(builtin_model("resnet50")))


def test_canonical_json_and_fingerprint_are_stable():
    plan = plan_buckets(builtin_model("mlp-25m"))
    text = canonical_json(plan.to_json())
    assert " " not in text and text == canonical_json(json.loads(text))
    assert plan.to_json()["version"] == 1
    # A fingerprint is a function of the value only, and changes with any field.
    assert plan.fingerprint == BucketPlan.from_json(json.loads(text)).fingerprint
    assert plan.fingerprint != plan_buckets(builtin_model("mlp-25m"), align=2).fingerprint


def test_round_trips_of_every_plan_kind():
    specs = builtin_model("gpt2-small")
    buckets = plan_buckets(specs, pad_to=4)
    for plan, cls in [
        (buckets, BucketPlan),
        (plan_greedy_shards(specs, world_size=4), ShardPlan),
        (plan_flat_shards(buckets, world_size=4), ShardPlan),
        (Topology.create(world_size=16, tp=2, cp=2, order="tp-dp-cp-ep-pp"), Topology),
    ]:
        assert cls.from_json(json.loads(json.dumps(plan.to_json()))) == plan


def test_from_json_rejects_other_kinds_and_versions():
    obj = plan_buckets(builtin_model("mlp-25m")).to_json()
    with pytest.raises(ValueError, match="expected a 'shard_plan' plan, got kind 'bucket_plan'"):
        ShardPlan.from_json(obj)
    with pytest.raises(ValueError, match="has version 99; this gradsync reads version 1"):
        BucketPlan.from_json(obj | {"version": 99})


@pytest.mark.parametrize(
    ("model", "numel", "count"),
    [("gpt2-small", 124_439_808, 148), ("resnet50", 25_557_032, 161), ("mlp-25m", 25_190_400, 48)],
)
def test_builtin_models_have_the_published_sizes(model, numel, count):
    specs = builtin_model(model)
    assert sum(s.numel for s in specs) == numel and len(specs) == count


def test_unknown_model():
    with pytest.raises(ValueError, match="unknown model 'gpt5'; built-in models: gpt2-small"):
        builtin_model("gpt5")


@given(
    st.lists(
        st.tuples(
            st.text(min_size=1, max_size=8),
            st.lists(st.integers(0, 9), max_size=3),
            st.sampled_from(["float32", "bfloat16", "int8"]),
            st.booleans(),
        ),
        max_size=10,
        unique_by=lambda r: r[0],
    )
)
def test_bucket_plan_json_round_trip_is_identity(rows):
    specs = [ParamSpec(name=n, shape=tuple(s), dtype=d, requires_grad=r) for n, s, d, r in rows]
    plan = plan_buckets(specs, cap_bytes=64, align=2)
    assert BucketPlan.from_json(json.loads(canonical_json(plan.to_json()))) == plan
