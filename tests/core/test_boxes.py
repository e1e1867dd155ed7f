"""Boxes (gradsync_core/checkpoint/_boxes.py): what a checkpoint that crosses layouts writes
and reads, checked element by element against brute force on Megatron-style layouts."""

import itertools
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import ParamSpec
from gradsync_core.checkpoint import (
    Box,
    box_windows,
    distinct_boxes,
    plan_box_shards,
    plan_weight_owners,
    shard_region,
    state_reads,
    transfers,
)


def elements(shape, start, stop):
    """Flat indices of a box, row-major, by brute force."""
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    ranges = [range(a, b) for a, b in zip(start, stop, strict=True)]
    return [
        sum(i * s for i, s in zip(idx, strides, strict=True)) for idx in itertools.product(*ranges)
    ]


def chunks(rows, parts):
    """FSDP2's cut: chunks of ceil(rows / parts), the last ones short or empty."""
    size = -(-rows // parts)
    return [(min(rows, i * size), min(rows, (i + 1) * size)) for i in range(parts)]


def layout(shape, *, tp, tp_dim, dp, replicas):
    """Every rank's box of one parameter: tp slices along ``tp_dim`` (None: replicated over
    tp), dp chunks of the local rows, each box held by ``replicas`` ranks."""
    boxes, rank = [], 0
    for _ in range(replicas):
        for t in range(tp):
            start, stop = [0] * len(shape), list(shape)
            if tp_dim is not None:
                width = shape[tp_dim] // tp
                start[tp_dim], stop[tp_dim] = t * width, (t + 1) * width
            for lo, hi in chunks(stop[0] - start[0], dp):
                first = start[0]
                box_start, box_stop = list(start), list(stop)
                box_start[0], box_stop[0] = first + lo, first + hi
                boxes.append(Box(name="w", rank=rank, start=tuple(box_start), stop=tuple(box_stop)))
                rank += 1
    return boxes, rank


@pytest.mark.parametrize(
    ("start", "stop", "shape", "expected"),
    [
        ((0, 0), (4, 4), (4, 4), [(0, 16)]),  # whole
        ((1, 0), (3, 4), (4, 4), [(4, 12)]),  # rows: one range
        ((1, 2), (3, 4), (4, 4), [(6, 8), (10, 12)]),  # a column slice: one range per row
        ((1, 0, 0), (2, 3, 2), (4, 3, 2), [(6, 12)]),  # an expert
        ((0, 1, 0), (2, 2, 2), (2, 3, 2), [(2, 4), (8, 10)]),
        ((), (), (), [(0, 1)]),  # 0-d
        ((2, 0), (2, 4), (4, 4), []),  # empty
    ],
    ids=["whole", "rows", "columns", "expert", "middle", "scalar", "empty"],
)
def test_box_windows(start, stop, shape, expected):
    box = Box(name="w", rank=0, start=start, stop=stop)
    got = [(w.start, w.stop) for w in box_windows(box, shape)]
    assert got == expected
    flat = [e for a, b in got for e in range(a, b)]
    assert flat == (elements(shape, start, stop) if shape else [0])


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 9),
    cols=st.integers(1, 3),
    tp=st.sampled_from([1, 2]),
    tp_dim=st.sampled_from([None, 0, 1]),
    dp=st.integers(1, 4),
    replicas=st.integers(1, 2),
)
def test_every_element_is_written_once_and_each_share_is_assembled(
    rows, cols, tp, tp_dim, dp, replicas
):
    shape = (rows * (tp if tp_dim == 0 else 1), cols * (tp if tp_dim == 1 else 1))
    boxes, world = layout(shape, tp=tp, tp_dim=tp_dim, dp=dp, replicas=replicas)
    spec = ParamSpec(name="w", shape=shape)
    kept = distinct_boxes(boxes, [spec])
    # One replica of each box: the lowest ranks, the first replica's.
    assert all(b.rank < world // replicas for b in kept["w"])
    plan = plan_box_shards([spec], kept, {"w": 0}, world_size=world)
    written = sorted(e for s in plan.shards for e in range(s.start, s.stop))
    assert written == list(range(math.prod(shape)))  # every element once
    assert len({s.rank for s in plan.shards}) == len(plan.shards)  # one range per rank file
    for shard in plan.shards:
        start, stop = shard_region(shard, shape)
        parts = transfers("w", kept["w"], shard.rank, start, stop)
        got = sorted(e for t in parts for e in elements(shape, t.start, t.stop))
        assert got == list(range(shard.start, shard.stop))
        for part in parts:  # each source holds what it gives
            box = next(b for b in kept["w"] if b.rank == part.source)
            assert all(
                a <= x and y <= b
                for a, b, x, y in zip(box.start, box.stop, part.start, part.stop, strict=True)
            )
    # And back: any rank's box reads exactly its elements from the shards.
    for box in boxes:
        reads = state_reads(plan, box_windows(box, shape), {"w": ["exp_avg"]})
        got = []
        for read in reads:
            shard = next(s for s in plan.shards if s.rank == read.rank)
            got += range(shard.start + read.start, shard.start + read.stop)
        assert got == elements(shape, box.start, box.stop)


def test_a_0d_parameter_is_written_by_one_rank():
    boxes = [Box(name="s", rank=r, start=(), stop=()) for r in (3, 1, 2)]
    spec = ParamSpec(name="s", shape=())
    plan = plan_box_shards([spec], distinct_boxes(boxes, [spec]), {}, world_size=4)
    assert [(s.rank, s.start, s.stop) for s in plan.shards] == [(1, 0, 1)]


@pytest.mark.parametrize(
    ("boxes", "match"),
    [
        ([Box(name="w", rank=0, start=(0, 0), stop=(2, 4))], "hold 8 of the 16 elements"),
        (
            [
                Box(name="w", rank=0, start=(0, 0), stop=(3, 4)),
                Box(name="w", rank=1, start=(2, 0), stop=(4, 4)),
            ],
            "ranks 0 and 1 hold overlapping but different boxes",
        ),
        ([Box(name="w", rank=0, start=(0, 0), stop=(5, 4))], "not inside the parameter's shape"),
        ([Box(name="w", rank=0, start=(0,), stop=(4,))], "has 1 dims but the parameter"),
        ([Box(name="v", rank=2, start=(0,), stop=(4,))], "rank 2 holds a box of 'v'"),
    ],
    ids=["missing", "overlap", "outside", "dims", "unknown"],
)
def test_boxes_that_are_not_one_layout_are_refused(boxes, match):
    with pytest.raises(ValueError, match=match):
        distinct_boxes(boxes, [ParamSpec(name="w", shape=(4, 4))])


def test_weights_spread_over_the_ranks_that_write_their_state():
    """Eight equal parameters, each in row chunks over 4 ranks: each rank writes two whole
    weights (the first rank of each chunk would take all eight), and always one that holds
    a range of that parameter's state."""
    specs = [ParamSpec(name=f"w{i}", shape=(8, 2)) for i in range(8)]
    boxes = [
        Box(name=spec.name, rank=r, start=(2 * r, 0), stop=(2 * r + 2, 2))
        for spec in specs
        for r in range(4)
    ]
    plan = plan_box_shards(specs, distinct_boxes(boxes, specs), {}, world_size=4)
    owners = plan_weight_owners(plan, specs)
    assert sorted(owners.values()) == [0, 0, 1, 1, 2, 2, 3, 3]
    for name, rank in owners.items():
        assert any(s.name == name and s.rank == rank for s in plan.shards)
