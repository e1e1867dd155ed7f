"""Topology groups: Megatron-core's order semantics, mesh equivalence, split_shapes (§5)."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import STANDARD_GROUPS, Topology, split_shapes
from gradsync_core.plan._rank_generator import RankGenerator


def megatron_groups(world_size, parallel_size, mask):
    """An independent transcription of Megatron-core's
    ``generate_masked_orthogonal_rank_groups`` (decompose the group and in-group indices into
    masked / unmasked coordinates, first axis fastest) to compare against."""

    def prefix_product(a):
        out = [1]
        for v in a:
            out.append(out[-1] * v)
        return out

    def decompose(index, shape):
        stride = prefix_product(shape)
        return [(index // d) % s for s, d in zip(shape, stride, strict=False)]

    masked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if m]
    unmasked_shape = [s for s, m in zip(parallel_size, mask, strict=True) if not m]
    stride = prefix_product(parallel_size)
    masked_stride = [d for d, m in zip(stride, mask, strict=False) if m]
    unmasked_stride = [d for d, m in zip(stride, mask, strict=False) if not m]
    group_size = math.prod(masked_shape)
    groups = []
    for g in range(world_size // group_size):
        gi = decompose(g, unmasked_shape)
        groups.append(
            tuple(
                sum(x * y for x, y in zip(decompose(r, masked_shape), masked_stride, strict=True))
                + sum(x * y for x, y in zip(gi, unmasked_stride, strict=True))
                for r in range(group_size)
            )
        )
    return tuple(groups)


def test_design_worked_example():
    topo = Topology.create(world_size=8, tp=2, cp=2)
    assert topo.dp == 2
    assert topo.groups("tp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.groups("cp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topo.groups("dp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.groups("tp-cp") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert topo.groups("dp-cp") == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert topo.groups("cp-dp") == topo.groups("dp-cp")  # membership, not spelling
    assert topo.coordinates(5) == {"tp": 1, "cp": 0, "ep": 0, "dp": 1, "pp": 0}
    assert topo.group_of("dp-cp", 5) == (1, 3, 5, 7)
    assert topo.group_rank("dp-cp", 5) == 2
    assert topo.mesh_shape == (1, 2, 1, 2, 2)
    assert topo.mesh_axis_names == ("pp", "dp", "ep", "cp", "tp")
    assert topo.mesh_axes("dp-cp") == ("dp", "cp")


def test_order_swapped_case():
    # dp varies fastest: data-parallel peers become neighbours.
    topo = Topology.create(world_size=8, tp=2, cp=2, order="dp-tp-cp-ep-pp")
    assert topo.groups("dp") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert topo.groups("tp") == ((0, 2), (1, 3), (4, 6), (5, 7))
    assert topo.groups("cp") == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert topo.groups("tp-cp") == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_size_one_axes_may_be_left_out_of_the_order():
    topo = Topology.create(world_size=4, tp=2, order="tp-dp")
    assert topo.order == "tp-dp-cp-ep-pp"
    with pytest.raises(ValueError, match="leaves out \\['cp'\\], whose size is > 1"):
        Topology(tp=2, cp=2, order="tp-dp")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 8, "tp": 3}, "does not divide world_size = 8"),
        ({"world_size": 8, "tp": 2, "dp": 3}, "= 6 but world_size = 8; pass dp=-1"),
        ({"world_size": 8, "order": "tp-tp"}, "distinct axes"),
        ({"world_size": 8, "order": "tp-xx"}, "distinct axes"),
        ({"world_size": 0}, "positive int"),
    ],
    ids=["not-divisible", "explicit-dp-mismatch", "repeated-axis", "unknown-axis", "zero"],
)
def test_bad_topologies(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology.create(**kwargs)


def test_bad_group_names_and_ranks():
    topo = Topology.create(world_size=4, tp=2)
    with pytest.raises(ValueError, match="must join distinct axes"):
        topo.groups("tp-foo")
    with pytest.raises(ValueError, match="outside a world of 4"):
        topo.coordinates(4)


axis_sizes = st.sampled_from([1, 1, 2, 2, 3])


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.tuples(axis_sizes, axis_sizes, axis_sizes, axis_sizes, axis_sizes),
    order=st.permutations(["tp", "cp", "ep", "dp", "pp"]),
    members=st.sets(st.sampled_from(["tp", "cp", "ep", "dp", "pp"]), min_size=1),
)
def test_groups_match_megatron_and_partition_the_world(sizes, order, members):
    # ep is carved out of dp: with ep = 1 the dense generator is the whole story and
    # every five-axis name still resolves; expert layouts are covered by the tests below.
    tp, cp, _, dp, pp = sizes
    ep = 1
    topo = Topology(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order="-".join(order))
    name = "-".join(sorted(members))
    groups = topo.groups(name)
    parallel_size = [getattr(topo, t) for t in order]
    mask = [t in members for t in order]
    assert groups == megatron_groups(topo.world_size, parallel_size, mask)
    # a partition of the world into ascending groups of the right size
    flat = sorted(itertools.chain.from_iterable(groups))
    assert flat == list(range(topo.world_size))
    assert all(list(g) == sorted(g) and len(g) == topo.group_size(name) for g in groups)
    # every rank's group, place and coordinates agree with the enumeration
    for g in groups:
        for place, rank in enumerate(g):
            assert topo.group_of(name, rank) == g
            assert topo.group_rank(name, rank) == place
            assert topo.rank_of(**topo.coordinates(rank)) == rank
    # a group is a fibre of the mesh arange(world).reshape(mesh_shape) along its axes
    axes = [topo.mesh_axis_names.index(a) for a in topo.mesh_axes(name)]
    assert len(groups) * topo.group_size(name) == math.prod(topo.mesh_shape)
    for rank in (0, topo.world_size - 1):
        index = list(_unravel(rank, topo.mesh_shape))
        fibre = []
        for combo in itertools.product(*(range(topo.mesh_shape[a]) for a in axes)):
            for a, c in zip(axes, combo, strict=True):
                index[a] = c
            fibre.append(_ravel(index, topo.mesh_shape))
        assert sorted(fibre) == list(topo.group_of(name, rank))
    assert Topology.from_json(topo.to_json()) == topo


def _unravel(rank, shape):
    out = []
    for size in reversed(shape):
        out.append(rank % size)
        rank //= size
    return tuple(reversed(out))


def _ravel(index, shape):
    rank = 0
    for i, size in zip(index, shape, strict=True):
        rank = rank * size + i
    return rank


def test_standard_groups_exist_on_every_topology():
    topo = Topology.create(world_size=16, tp=2, cp=2, pp=2)
    for name in STANDARD_GROUPS:
        assert sum(len(g) for g in topo.groups(name)) == 16


@pytest.mark.parametrize(
    ("size", "parts", "expected"),
    [
        (10, 4, (3, 3, 3, 1)),
        (9, 4, (2, 2, 2, 3)),
        (5, 4, (1, 1, 1, 2)),
        (8, 4, (2, 2, 2, 2)),
        (7, 1, (7,)),
        (4, 4, (1, 1, 1, 1)),
    ],
)
def test_split_shapes(size, parts, expected):
    assert split_shapes(size, parts) == expected


def test_split_shapes_rejects_too_few_elements():
    with pytest.raises(ValueError, match="cannot split a dimension of 3 over 4 ranks"):
        split_shapes(3, 4)


@given(size=st.integers(1, 500), parts=st.integers(1, 64))
def test_split_shapes_properties(size, parts):
    if size < parts:
        return
    chunks = split_shapes(size, parts)
    assert len(chunks) == parts and sum(chunks) == size and min(chunks) >= 1
    assert len(set(chunks[:-1])) <= 1


@settings(max_examples=100, deadline=None)
@given(
    sizes=st.tuples(axis_sizes, axis_sizes, axis_sizes, axis_sizes, axis_sizes),
    order=st.permutations(["tp", "cp", "ep", "dp", "pp"]),
    members=st.sets(st.sampled_from(["tp", "cp", "ep", "dp", "pp"]), min_size=1),
)
def test_groups_by_arithmetic_match_the_enumeration(sizes, order, members):
    tp, cp, _, dp, pp = sizes  # ep = 1: see test_groups_match_megatron_and_partition_the_world
    topo = Topology(tp=tp, cp=cp, dp=dp, pp=pp, order="-".join(order))
    name = "-".join(sorted(members))
    groups = topo.groups(name)
    assert topo.group_count(name) == len(groups)
    for index, group in enumerate(groups):
        assert topo.group_at(name, index) == group
        assert [topo.rank_at(name, index, p) for p in range(len(group))] == list(group)


def test_one_group_of_a_million_ranks_without_listing_the_world():
    topo = Topology.create(world_size=1 << 20, tp=8, cp=2, pp=4)
    assert topo.dp == 1 << 14 and topo.group_count("tp") == 1 << 17
    assert topo.rank_at("dp", 0, topo.group_size("dp") - 1) == (topo.dp - 1) * 16
    assert topo.group_at("pp", 5) == (5, 5 + (1 << 18), 5 + (2 << 18), 5 + (3 << 18))
    rank = 123_457
    assert topo.group_rank("dp-cp", rank) == topo.group_of("dp-cp", rank).index(rank)


@pytest.mark.parametrize(
    ("index", "place"),
    [(4, 0), (-1, 0), (0, 2), (0, -1), (True, 0)],
    ids=["group-past-end", "group-negative", "place-past-end", "place-negative", "bool"],
)
def test_rank_at_outside_the_groups(index, place):
    topo = Topology.create(world_size=8, tp=2)
    with pytest.raises(ValueError, match="outside the 4 'tp' groups of 2 ranks each"):
        topo.rank_at("tp", index, place)


# --- expert layouts: Megatron-core's second rank generator -------------------------

# (create kwargs, dense groups, expert groups): checked by hand from the rule "first token of the
# order varies fastest"; the dense generator drops ep, the expert one drops cp and uses etp, edp.
MOE_CASES = {
    "w16-tp2-ep4": (
        {"world_size": 16, "tp": 2, "ep": 4},
        {"dp": ((0, 2, 4, 6, 8, 10, 12, 14), (1, 3, 5, 7, 9, 11, 13, 15))},
        {
            "ep": ((0, 2, 4, 6), (1, 3, 5, 7), (8, 10, 12, 14), (9, 11, 13, 15)),
            "edp": tuple((r, r + 8) for r in range(8)),
            "etp-ep": ((0, 1, 2, 3, 4, 5, 6, 7), (8, 9, 10, 11, 12, 13, 14, 15)),
        },
    ),
    "w8-tp2-ep4-etp1": (
        {"world_size": 8, "tp": 2, "ep": 4, "etp": 1},
        {"tp": ((0, 1), (2, 3), (4, 5), (6, 7)), "dp": ((0, 2, 4, 6), (1, 3, 5, 7))},
        {
            "ep": ((0, 1, 2, 3), (4, 5, 6, 7)),
            "etp": tuple((r,) for r in range(8)),
            "edp": ((0, 4), (1, 5), (2, 6), (3, 7)),
        },
    ),
    "w8-cp2-ep2-pp2": (
        {"world_size": 8, "cp": 2, "ep": 2, "pp": 2},
        {"cp": ((0, 1), (2, 3), (4, 5), (6, 7)), "dp-cp": ((0, 1, 2, 3), (4, 5, 6, 7))},
        {
            "ep": ((0, 1), (2, 3), (4, 5), (6, 7)),
            "edp": ((0, 2), (1, 3), (4, 6), (5, 7)),
            "etp-ep-pp": ((0, 1, 4, 5), (2, 3, 6, 7)),
        },
    ),
    "w8-ep2-dp-first": (
        {"world_size": 8, "ep": 2, "order": "dp-ep-tp-cp-pp"},
        {"dp": (tuple(range(8)),)},
        {"ep": ((0, 4), (1, 5), (2, 6), (3, 7)), "edp": ((0, 1, 2, 3), (4, 5, 6, 7))},
    ),
}


@pytest.mark.parametrize("case", list(MOE_CASES.values()), ids=list(MOE_CASES))
def test_expert_layouts_by_hand(case):
    kwargs, dense, expert = case
    topo = Topology.create(**kwargs)
    assert topo.dp == kwargs["world_size"] // (topo.tp * topo.cp * topo.pp)
    assert topo.edp == kwargs["world_size"] // (topo.etp * topo.ep * topo.pp)
    for name, groups in dense.items():
        assert topo.groups(name) == groups and not topo.is_expert_group(name)
    for name, groups in expert.items():
        assert topo.groups(name) == groups and topo.is_expert_group(name)
    assert topo.groups("pp") == topo.expert.groups("pp")
    assert Topology.from_json(topo.to_json()) == topo


# The existing cases above, without experts: groups, JSON and fingerprints pinned (the values the
# topology had before expert layouts existed), so earlier plans and checkpoints stay valid.
EP_FREE = {
    "w8-tp2-cp2": (
        {"world_size": 8, "tp": 2, "cp": 2},
        "ca0acfd7e6c4a979964ea9e5496cb55cc726a83e6cf27390ba9a0cec9d03c525",
    ),
    "w8-tp2-cp2-dp-first": (
        {"world_size": 8, "tp": 2, "cp": 2, "order": "dp-tp-cp-ep-pp"},
        "736baac7a1b8ffe2abe9804506953937e464c8909848b924cafe055d8c656b72",
    ),
    "w16-tp2-cp2-pp2": (
        {"world_size": 16, "tp": 2, "cp": 2, "pp": 2},
        "b423b073c764c1b5f7d3962cc1fba5f268db57328c03c471ef710e48c73680bc",
    ),
    "w4-tp2-tp-dp": (
        {"world_size": 4, "tp": 2, "order": "tp-dp"},
        "7e9eb524e831bc226f59f4f3a41282f89e10269dde907860ff3b8f1e88f2f775",
    ),
}


@pytest.mark.parametrize("case", list(EP_FREE.values()), ids=list(EP_FREE))
def test_topologies_without_experts_are_unchanged(case):
    kwargs, expected_fingerprint = case
    topo = Topology.create(**kwargs)
    assert not topo.has_experts and topo.etp == topo.tp and topo.edp == topo.dp * topo.cp
    assert "etp" not in topo.to_json()
    assert topo.fingerprint == expected_fingerprint
    parallel_size = [getattr(topo, t) for t in topo.tokens]
    for members in itertools.chain.from_iterable(
        itertools.combinations(topo.tokens, k) for k in range(1, 6)
    ):
        mask = [t in members for t in topo.tokens]
        assert topo.groups("-".join(members)) == megatron_groups(
            topo.world_size, parallel_size, mask
        )
    # Without experts the expert tp groups are the dense ones where tp varies fastest (the
    # expert generator folds cp into edp, which moves etp's stride when dp or cp comes first).
    if topo.tokens[0] == "tp":
        for expert, dense in {"etp": "tp", "etp-ep": "tp", "etp-ep-pp": "tp-pp"}.items():
            assert topo.groups(expert) == topo.groups(dense)


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.tuples(*[st.sampled_from([1, 1, 2, 2, 3])] * 5),
    pp_last=st.booleans(),
    order=st.permutations(["tp", "cp", "ep", "dp"]),
)
def test_expert_groups_match_megatron_and_partition_the_world(sizes, pp_last, order):
    tp, cp, etp, ep, pp = sizes
    world = tp * cp * pp * etp * ep  # divisible by both model sizes
    tokens = [*order, "pp"] if pp_last else ["pp", *order]
    try:
        topo = Topology.create(world, tp=tp, cp=cp, ep=ep, etp=etp, pp=pp, order="-".join(tokens))
        topo.groups("edp")  # without experts the expert rules are checked here
    except ValueError as err:  # Megatron-core's pp-last rule
        assert not pp_last and "put pp last" in str(err)
        return
    gen_sizes = {"tp": etp, "cp": 1, "ep": ep, "dp": topo.edp, "pp": pp}
    parallel_size = [gen_sizes[t] for t in topo.tokens]
    for name, members in {
        "ep": ("ep",),
        "etp": ("tp",),
        "edp": ("dp",),
        "etp-ep": ("tp", "ep"),
        "etp-ep-pp": ("tp", "ep", "pp"),
    }.items():
        mask = [t in members for t in topo.tokens]
        groups = topo.groups(name)
        assert groups == megatron_groups(world, parallel_size, mask)
        assert topo.group_count(name) == len(groups)
        for index, group in enumerate(groups):
            assert topo.group_at(name, index) == group
            for place, rank in enumerate(group):
                assert topo.group_of(name, rank) == group
                assert topo.group_rank(name, rank) == place
    for rank in range(world):
        assert topo.rank_of(**topo.coordinates(rank)) == rank
    assert Topology.from_json(topo.to_json()) == topo


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"world_size": 8, "ep": 3},
            "etp\\*ep\\*pp = 1\\*3\\*1 = 3 does not divide world_size = 8",
        ),
        ({"world_size": 8, "tp": 2, "ep": 8}, "= 16 does not divide world_size = 8"),
        (
            {"world_size": 8, "tp": 2, "ep": 2, "pp": 2, "etp": 1, "order": "tp-pp-cp-ep-dp"},
            "put pp last",
        ),
        ({"world_size": 8, "ep": 2, "etp": 0}, "etp must be a positive int, got 0"),
    ],
    ids=["ep-not-dividing", "etp-ep-too-large", "pp-not-last", "etp-zero"],
)
def test_bad_expert_topologies(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology.create(**kwargs)


def test_dense_and_expert_axes_do_not_mix():
    topo = Topology.create(world_size=8, tp=2, ep=2)
    with pytest.raises(ValueError, match="mixes dense axes \\['tp'\\] with expert axes"):
        topo.groups("tp-ep")
    with pytest.raises(ValueError, match="mixes dense axes \\['dp'\\] with expert axes"):
        topo.groups("dp-etp")
    # without experts ep is a size-1 dense axis and the old five-axis names keep working
    assert Topology.create(world_size=8, tp=2).groups("tp-ep") == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_a_rank_generator_refuses_ep_and_cp_together():
    with pytest.raises(ValueError, match="ep = 2 and cp = 2 are both > 1 in one rank generator"):
        RankGenerator(ep=2, cp=2)
    shifted = RankGenerator(tp=2, dp=2, rank_offset=4)
    assert shifted.groups("tp") == ((4, 5), (6, 7)) and shifted.group_of("dp", 5) == (5, 7)
    assert shifted.rank_at("dp", 1, 1) == 7 and shifted.group_rank("dp", 6) == 1


def test_expert_mesh_fibres_are_the_expert_groups():
    topo = Topology.create(world_size=16, tp=2, ep=4, etp=1)
    assert topo.expert_mesh_axis_names == ("pp", "edp", "ep", "etp")
    assert topo.expert_mesh_shape == (1, 4, 4, 1)
    assert topo.mesh_axes("edp") == ("edp",) and topo.mesh_axes("dp-cp") == ("dp", "cp")
    mesh = [list(range(16))[i * 4 : i * 4 + 4] for i in range(4)]  # (edp, ep), etp = pp = 1
    assert tuple(tuple(row) for row in mesh) == topo.groups("ep")
    assert tuple(zip(*mesh, strict=True)) == topo.groups("edp")


def test_cli_plan_prints_dense_and_expert_groups(capsys):
    from gradsync_core.cli._main import main

    assert main(["plan", "--world-size", "16", "--tp", "2", "--ep", "4", "--etp", "1"]) == 0
    out = capsys.readouterr().out
    assert "tp 2 x cp 1 x dp 8 x pp 1; experts: etp 1 x ep 4 x edp 4 x pp 1" in out
    assert "expert mesh shape (1, 4, 4, 1) axes ('pp', 'edp', 'ep', 'etp')" in out
    rows = {line.split()[0]: line.split()[1:3] for line in out.splitlines() if line[:1] == " "}
    assert rows["dp"] == ["8", "2"] and rows["edp"] == ["4", "4"] and rows["ep"] == ["4", "4"]
    assert main(["plan", "--world-size", "8", "--ep", "3"]) == 2
    assert "etp*ep*pp = 1*3*1 = 3 does not divide world_size = 8" in capsys.readouterr().err


def test_axis_sizes_and_mesh_sizes_read_one_place():
    topo = Topology.create(16, tp=2, ep=2, pp=2)
    assert topo.mesh_sizes() == dict(zip(topo.mesh_axis_names, topo.mesh_shape, strict=True))
    assert topo.mesh_sizes(expert=True) == dict(
        zip(topo.expert_mesh_axis_names, topo.expert_mesh_shape, strict=True)
    )
    assert [topo.size(a) for a in ("tp", "cp", "ep", "dp", "pp", "etp", "edp")] == [
        2,
        1,
        2,
        4,
        2,
        2,
        2,
    ]
    assert topo.enabled("tp") and not topo.enabled("cp")
    with pytest.raises(ValueError, match="unknown axis 'xp'"):
        topo.size("xp")


def today_hsdp_groups(topo: Topology, shard: int) -> tuple[list[tuple], list[tuple]]:
    """The shard and replicate groups of gradsync_torch's ``hsdp_mesh`` before HSDP was part
    of the topology (an independent transcription): each dp group cut into rows of ``shard``
    consecutive members (the shard groups) and the columns of those rows (the replicas)."""
    shards, replicas = [], []
    for ranks in topo.groups("dp"):
        rows = [ranks[i : i + shard] for i in range(0, len(ranks), shard)]
        shards += rows
        replicas += [tuple(row[c] for row in rows) for c in range(shard)]
    return shards, replicas


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.tuples(axis_sizes, axis_sizes, st.sampled_from([1, 2, 4, 6]), axis_sizes),
    order=st.permutations(["tp", "cp", "ep", "dp", "pp"]),
    shard_index=st.integers(0, 5),
    members=st.sets(st.sampled_from(["tp", "cp", "dp_shard", "dp_replicate", "pp"]), min_size=1),
)
def test_hsdp_groups_partition_the_world_and_equal_todays_hsdp_mesh(
    sizes, order, shard_index, members
):
    tp, cp, dp, pp = sizes
    divisors = [d for d in range(1, dp + 1) if dp % d == 0]
    shard = divisors[shard_index % len(divisors)]
    world = tp * cp * dp * pp
    topo = Topology.create(world, tp=tp, cp=cp, pp=pp, order="-".join(order), dp_shard=shard)
    assert (topo.dp_shard, topo.dp_replicate, topo.hsdp) == (shard, dp // shard, shard != dp)
    shards, replicas = today_hsdp_groups(topo, shard)
    assert sorted(topo.groups("dp_shard")) == sorted(shards)
    assert sorted(topo.groups("dp_replicate")) == sorted(replicas)
    assert topo.groups("dp_shard-dp_replicate") == topo.groups("dp")
    # any group with the HSDP parts: a partition of the world, consistent by rank
    name = "-".join(sorted(members))
    groups = topo.groups(name)
    assert sorted(itertools.chain.from_iterable(groups)) == list(range(world))
    assert all(len(g) == topo.group_size(name) for g in groups)
    for g in groups:
        for place, rank in enumerate(g):
            assert topo.group_of(name, rank) == g and topo.group_rank(name, rank) == place
            assert topo.rank_at(name, groups.index(g), place) == rank
            assert topo.rank_of(**topo.coordinates(rank)) == rank
    # the mesh: the shard axis next to (faster than) the replicate axis, fibres are groups
    shape, names = topo.mesh_shape, topo.mesh_axis_names
    if topo.hsdp:
        at = names.index("dp_replicate")
        assert names[at + 1] == "dp_shard" and "dp" not in names
        assert topo.mesh_axes("dp") == ("dp_replicate", "dp_shard")
    for group_name in (name, "dp", "dp_shard", "dp_replicate"):
        axes = [names.index(a) for a in topo.mesh_axes(group_name)]
        index = list(_unravel(world - 1, shape))
        fibre = []
        for combo in itertools.product(*(range(shape[a]) for a in axes)):
            for a, c in zip(axes, combo, strict=True):
                index[a] = c
            fibre.append(_ravel(index, shape))
        assert sorted(fibre) == list(topo.group_of(group_name, world - 1))
    assert Topology.from_json(topo.to_json()) == topo


@pytest.mark.parametrize("case", list(EP_FREE.values()), ids=list(EP_FREE))
def test_dp_shard_equal_to_dp_is_no_hsdp(case):
    """dp_shard = dp (the default) changes no group, no mesh axis, no JSON, no fingerprint."""
    kwargs, expected_fingerprint = case
    plain = Topology.create(**kwargs)
    topo = Topology.create(**kwargs, dp_shard=plain.dp)
    assert topo == plain and not topo.hsdp and topo.dp_replicate == 1
    assert topo.to_json() == plain.to_json() and "dp_shard" not in topo.to_json()
    assert topo.fingerprint == expected_fingerprint
    assert topo.mesh_axis_names == plain.mesh_axis_names and topo.coordinates(
        1
    ) == plain.coordinates(1)
    assert topo.groups("dp_shard") == topo.groups("dp") and topo.mesh_axes("dp_shard") == ("dp",)
    assert all(len(g) == 1 for g in topo.groups("dp_replicate"))


def test_hsdp_topology_json_names_dp_shard():
    topo = Topology.create(world_size=16, tp=2, dp_shard=2)
    assert (
        topo.to_json()["dp_shard"] == 2
        and topo.fingerprint != Topology.create(16, tp=2).fingerprint
    )
    assert Topology.from_json(topo.to_json()) == topo
    assert topo.coordinates(5) == {
        "tp": 1,
        "cp": 0,
        "ep": 0,
        "dp": 2,
        "pp": 0,
        "dp_shard": 0,
        "dp_replicate": 1,
    }
    assert [topo.size(a) for a in ("dp", "dp_shard", "dp_replicate")] == [8, 2, 4]
    assert topo.enabled("dp_replicate") and topo.mesh_axes("dp-cp") == (
        "dp_replicate",
        "dp_shard",
        "cp",
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"world_size": 8, "dp_shard": 3}, "dp_shard = 3 must be a positive divisor of dp = 8"),
        ({"world_size": 8, "tp": 2, "dp_shard": 8}, "dp_shard = 8 must be a positive divisor"),
        ({"world_size": 8, "dp_shard": 0}, "dp_shard = 0 must be a positive divisor"),
    ],
    ids=["not-a-divisor", "larger-than-dp", "zero"],
)
def test_bad_dp_shard(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Topology.create(**kwargs)


def test_hsdp_group_names_refuse_dp_with_its_parts():
    topo = Topology.create(world_size=8, dp_shard=4)
    with pytest.raises(ValueError, match="names dp and a part of it"):
        topo.groups("dp-dp_shard")
    moe = Topology.create(world_size=8, ep=2, dp_shard=2)
    with pytest.raises(ValueError, match="mixes dense axes"):
        moe.groups("dp_shard-ep")
    assert moe.groups("dp_shard") == ((0, 1), (2, 3), (4, 5), (6, 7))
