"""Matrix-owner plans (docs/matrix-optimizers.md) and the optimizer kinds both executors apply."""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    MatrixOwnerPlan,
    ParamSpec,
    matrix_cost,
    optimizer_kind,
    plan_matrix_owners,
)
from gradsync_core.plan import (
    OPTIMIZER_KINDS,
    TORCH_OPTIMIZERS,
    chunk_rows,
    optimizers_of_kind,
    owner_cost,
)


def spec(name, shape, requires_grad=True):
    return ParamSpec(name=name, shape=shape, requires_grad=requires_grad)


def gpt_matrices(layers, width, vocab=64):
    """The matrices a Muon user gives Muon in a GPT: attention and MLP weights (the
    embeddings and the head go to AdamW, as Muon's authors advise)."""
    specs = []
    for i in range(layers):
        specs += [
            spec(f"{i}.qkv.weight", (3 * width, width)),
            spec(f"{i}.proj.weight", (width, width)),
            spec(f"{i}.fc_in.weight", (4 * width, width)),
            spec(f"{i}.fc_out.weight", (width, 4 * width)),
        ]
    return specs


@pytest.mark.parametrize(
    ("shape", "cost", "expected"),
    [
        ((64, 16), "newton_schulz", 64 * 16 * 16),
        ((16, 64), "newton_schulz", 64 * 16 * 16),  # the short side, either way round
        ((8, 4, 6), "newton_schulz", 8 * 4 * 6 * 4),  # a batch of 8 (4, 6) matrices
        ((7,), "numel", 7),
        ((3, 5), "numel", 15),
    ],
    ids=["tall", "wide", "batched", "vector-numel", "matrix-numel"],
)
def test_matrix_cost_table(shape, cost, expected):
    assert matrix_cost(shape, cost) == expected


def test_matrix_cost_refuses_a_vector_and_an_unknown_cost():
    with pytest.raises(ValueError, match=r"shape \(7,\); give it to the elementwise optimizer"):
        matrix_cost((7,))
    with pytest.raises(ValueError, match="cost must be one of"):
        matrix_cost((2, 2), "flops")


def test_owners_balance_work_not_bytes():
    """A square matrix costs more than a flat one of the same size: by bytes the two would
    share a rank with the small one, by Newton-Schulz work the square one is alone."""
    specs = [spec("square", (64, 64)), spec("flat", (16, 256)), spec("small", (16, 16))]
    plan = plan_matrix_owners(specs, world_size=2)
    assert {m.name: m.owner for m in plan.matrices} == {"square": 0, "flat": 1, "small": 1}
    assert plan.rank_cost == (64**3, 16 * 256 * 16 + 16**3)


def test_the_plan_does_not_depend_on_the_order_of_the_specs():
    """torch lists a model's matrices in registration order, a Flax tree sorted: one plan."""
    specs = gpt_matrices(3, 16)
    forward = plan_matrix_owners(specs, world_size=4)
    assert forward == plan_matrix_owners(specs[::-1], world_size=4)
    assert forward.fingerprint == plan_matrix_owners(specs[::-1], world_size=4).fingerprint


def test_frozen_matrices_get_no_owner():
    plan = plan_matrix_owners([spec("a", (4, 4)), spec("f", (8, 8), False)], world_size=2)
    assert [m.name for m in plan.matrices] == ["a"]
    with pytest.raises(KeyError, match="not a matrix of this plan"):
        plan.owner("f")


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_world_size(bad):
    with pytest.raises(ValueError, match="world_size must be a positive int"):
        plan_matrix_owners([spec("a", (2, 2))], world_size=bad)


def test_gpt_owners_within_ten_percent_of_the_mean():
    """The benchmark's model (benchmarks/matrix_optimizers.py): 8 layers of width 256, at
    2, 4 and 8 ranks: the issue's target, 10 % of the mean work."""
    specs = gpt_matrices(8, 256)
    for world_size in (2, 4, 8):
        assert plan_matrix_owners(specs, world_size=world_size).imbalance <= 0.10


def test_shard_plan_is_the_same_owners_whole():
    plan = plan_matrix_owners(gpt_matrices(2, 8), world_size=3)
    shards = plan.shard_plan()
    assert shards.kind == "greedy"
    assert {s.name: s.rank for s in shards.shards} == {m.name: m.owner for m in plan.matrices}
    pairs = zip(shards.shards, plan.matrices, strict=True)
    assert all(s.start == 0 and s.stop == m.numel for s, m in pairs)


shapes = st.tuples(st.integers(1, 40), st.integers(1, 40))


@settings(max_examples=150, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=30), st.integers(1, 9))
def test_every_matrix_one_owner_and_the_balance_bound(shape_list, world_size):
    """Each matrix has exactly one owner in range; no rank's work exceeds the mean by more
    than the largest matrix's (list scheduling's bound); JSON round-trips to the same plan
    and fingerprint."""
    specs = [spec(f"w{i}", s) for i, s in enumerate(shape_list)]
    plan = plan_matrix_owners(specs, world_size=world_size)
    assert [m.name for m in plan.matrices] == sorted(s.name for s in specs)
    assert all(0 <= m.owner < world_size for m in plan.matrices)
    assert sum(len(plan.owned(r)) for r in range(world_size)) == len(specs)
    loads = plan.rank_cost
    biggest = max(m.cost for m in plan.matrices)
    assert max(loads) <= sum(loads) / world_size + biggest
    text = json.dumps(plan.to_json())
    again = MatrixOwnerPlan.from_json(json.loads(text))
    assert again == plan
    assert again.fingerprint == plan.fingerprint


@settings(max_examples=100, deadline=None)
@given(st.lists(shapes, min_size=1, max_size=12), st.integers(1, 6))
def test_rows_exchange_adds_up(shape_list, world_size):
    """What the ranks send is what the ranks receive, and each rank receives exactly the
    rows of its matrices it does not hold, twice (gradient and parameter)."""
    specs = [spec(f"w{i}", s) for i, s in enumerate(shape_list)]
    plan = plan_matrix_owners(specs, world_size=world_size)
    moves = [plan.rows_exchange(r) for r in range(world_size)]
    assert sum(m.sent_numel for m in moves) == sum(m.received_numel for m in moves)
    for rank, move in enumerate(moves):
        foreign = 0
        for m in plan.owned(rank):
            start, stop, _ = chunk_rows(m.shape[0], world_size, rank)
            foreign += m.numel - (stop - start) * m.shape[1]
        gradients_only = plan.rows_exchange(rank, with_params=False)
        assert move.received_numel - gradients_only.received_numel == foreign


def test_plan_json_is_versioned():
    obj = plan_matrix_owners([spec("a", (2, 3))], world_size=1).to_json()
    assert obj["kind"] == "matrix_owner_plan"
    with pytest.raises(ValueError, match="version"):
        MatrixOwnerPlan.from_json({**obj, "version": 99})


def test_every_torch_optimizer_has_one_kind():
    """The rule the refusals and the owner path read: torch's elementwise optimizers are the
    eleven ZeRO-2 and ZeRO-3 step in pieces, Muon and Adafactor step whole tensors, L-BFGS
    couples every parameter."""
    assert optimizers_of_kind("elementwise", torch=True) == [
        "ASGD", "Adadelta", "Adagrad", "Adam", "AdamW", "Adamax",
        "NAdam", "RAdam", "RMSprop", "Rprop", "SGD",
    ]  # fmt: skip
    assert optimizers_of_kind("per_tensor", torch=True) == ["Adafactor", "Muon"]
    assert optimizers_of_kind("coupled", torch=True) == ["LBFGS"]
    assert optimizer_kind("torch.optim.SparseAdam") == "unknown"
    assert set(TORCH_OPTIMIZERS.values()) <= set(OPTIMIZER_KINDS)
    assert owner_cost("torch.optim.Muon") == "newton_schulz"
    assert owner_cost("adafactor") == "numel"
