"""Which stored element ranges a load reads (gradsync_core.checkpoint.state_reads and
weight_reads, docs/design.md §9): for every plan kind a checkpoint can hold (greedy whole
tensors, flat and dim-0 slices) at any world size and any set of windows, the reads fill each
window exactly once and read nothing outside it. The files are simulated: each rank file's
stored tensor is what the saver writes (the whole parameter, or its flattened slice), and the
window is rebuilt from the reads alone. And which files each reader hashes (``hash_share``):
every file once, in about equal bytes."""

from __future__ import annotations

import math
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gradsync_core import (
    Manifest,
    ParamSpec,
    Shard,
    ShardPlan,
    plan_buckets,
    plan_flat_shards,
    plan_greedy_shards,
)
from gradsync_core.checkpoint import (
    Window,
    hash_share,
    plan_dim0_shards,
    rank_file,
    state_reads,
    tensor_key,
    weight_reads,
)

KEYS = ("exp_avg", "exp_avg_sq")
shapes = st.lists(
    st.lists(st.integers(1, 7), min_size=1, max_size=3).map(tuple), min_size=1, max_size=5
)


def make_plan(kind: str, specs: list[ParamSpec], world_size: int) -> ShardPlan:
    if kind == "greedy":
        return plan_greedy_shards(specs, world_size=world_size)
    if kind == "flat":
        buckets = plan_buckets(specs, cap_bytes=64, pad_to=world_size)
        return plan_flat_shards(buckets, world_size=world_size)
    return plan_dim0_shards(specs, [0] * len(specs), shard_size=world_size)


def stored_files(plan: ShardPlan, values: dict[str, list[int]]) -> dict[tuple[str, str], list]:
    """What a saver writes: ``(file, key) -> the stored tensor, flattened``."""
    files = {}
    for s in plan.shards:
        if s.stop > s.start:
            for key in KEYS:
                files[(rank_file(s.rank, plan.world_size), tensor_key(s.name, key))] = values[
                    s.name
                ][s.start : s.stop]
    return files


@settings(max_examples=300, deadline=None)
@given(
    shapes=shapes,
    kind=st.sampled_from(["greedy", "flat", "dim0"]),
    world_size=st.integers(1, 6),
    data=st.data(),
)
def test_reads_fill_each_window_exactly_and_nothing_else(shapes, kind, world_size, data):
    specs = [ParamSpec(name=f"p{i}", shape=shape) for i, shape in enumerate(shapes)]
    plan = make_plan(kind, specs, world_size)
    values = {s.name: [(s.name, e) for e in range(s.numel)] for s in specs}
    files = stored_files(plan, values)
    windows = []
    for s in specs:
        for _ in range(data.draw(st.integers(0, 3))):
            start = data.draw(st.integers(0, s.numel))
            windows.append(
                Window(name=s.name, start=start, stop=data.draw(st.integers(start, s.numel)))
            )
    reads = state_reads(plan, windows, {s.name: KEYS for s in specs})
    for window in windows:
        mine = [r for r in reads if r.window is window]
        assert mine, window
        if window.numel == 0:  # one empty read of the first stored piece: its dtypes, no data
            first = min(
                (s for s in plan.shards if s.name == window.name and s.numel), key=lambda s: s.start
            )
            assert [(r.rank, r.start, r.stop, r.at) for r in mine] == [(first.rank, 0, 0, 0)]
            continue
        for key in KEYS:
            rebuilt = [None] * window.numel
            for r in mine:
                assert r.keys == tuple(tensor_key(window.name, k) for k in KEYS)
                assert r.file == rank_file(r.rank, world_size)
                stored = files[(r.file, tensor_key(window.name, key))]
                assert 0 <= r.start < r.stop <= len(stored)  # inside the stored tensor
                for j in range(r.numel):
                    assert rebuilt[r.at + j] is None  # nothing read twice
                    rebuilt[r.at + j] = stored[r.start + j]
            # every element of the window, from the file that holds it, and only those
            assert rebuilt == values[window.name][window.start : window.stop]
        assert sum(r.numel for r in mine) == window.numel  # nothing outside the window
        assert [r.at for r in mine] == sorted(r.at for r in mine)


@settings(max_examples=100, deadline=None)
@given(shapes=shapes, world_size=st.integers(1, 6))
def test_whole_windows_read_every_stored_piece_once(shapes, world_size):
    """The windows of a whole-parameter load (``[0, numel)``) read each non-empty shard
    whole: what the ZeRO-1/2 loaders read."""
    specs = [ParamSpec(name=f"p{i}", shape=shape) for i, shape in enumerate(shapes)]
    for kind in ("greedy", "flat", "dim0"):
        plan = make_plan(kind, specs, world_size)
        whole = [Window(name=s.name, start=0, stop=s.numel) for s in specs]
        reads = state_reads(plan, whole, {s.name: ("m",) for s in specs})
        pieces = sorted((s.rank, s.start, s.stop) for s in plan.shards if s.stop > s.start)
        got = sorted(
            (r.rank, r.window.start + r.at, r.window.start + r.at + r.numel) for r in reads
        )
        assert got == pieces
        greedy = kind == "greedy"
        assert all(r.start == 0 and (not greedy or r.stop == r.window.numel) for r in reads)


def test_a_whole_stored_tensor_is_read_in_part() -> None:
    # A greedy (ZeRO-1) checkpoint stores the (4, 3) state whole in rank 1's file; a ZeRO-3
    # device keeping rows [1, 3) reads elements [3, 9) of it: the one contiguous byte range.
    plan = ShardPlan(
        kind="greedy",
        world_size=2,
        shards=(Shard(name="w", rank=1, start=0, stop=12, group=0),),
    )
    (read,) = state_reads(plan, [Window(name="w", start=3, stop=9)], {"w": ["exp_avg"]})
    assert (read.file, read.keys, read.start, read.stop, read.at) == (
        "rank-00001-of-00002.safetensors",
        ("w/exp_avg",),
        3,
        9,
        0,
    )


def test_parameters_without_stored_state_get_no_reads() -> None:
    plan = plan_greedy_shards([ParamSpec(name="w", shape=(4,))], world_size=2)
    windows = [Window(name="w", start=0, stop=4), Window(name="frozen", start=0, stop=2)]
    assert state_reads(plan, windows, {}) == ()
    # No keys yet (a parameter that never had a gradient): the pieces, with nothing to read.
    (read,) = state_reads(plan, windows, {"w": []})
    assert (read.keys, read.start, read.stop) == ((), 0, 4)
    # A parameter the plan does not list (frozen) has no stored state.
    assert len(state_reads(plan, windows, {"w": ["m"], "frozen": ["m"]})) == 1


def test_a_plan_that_does_not_tile_the_parameter_is_refused() -> None:
    def plan(*pieces: tuple[int, int, int]) -> ShardPlan:
        shards = tuple(Shard(name="w", rank=r, start=a, stop=b, group=0) for r, a, b in pieces)
        return ShardPlan(kind="flat", world_size=2, shards=shards)

    whole = [Window(name="w", start=0, stop=6)]
    with pytest.raises(ValueError, match=r"stores element 3 of 'w' in no rank file; the manifest"):
        state_reads(plan((0, 0, 3), (1, 4, 6)), whole, {"w": ["m"]})
    with pytest.raises(ValueError, match=r"stores element 2 of 'w' in two rank files"):
        state_reads(plan((0, 0, 4), (1, 2, 6)), whole, {"w": ["m"]})
    with pytest.raises(ValueError, match=r"stores element 5 of 'w' in no rank file"):
        state_reads(plan((0, 0, 3), (1, 3, 5)), whole, {"w": ["m"]})
    # A window inside what is stored reads fine even when the plan has a gap elsewhere.
    inside = [Window(name="w", start=4, stop=6)]
    assert len(state_reads(plan((0, 0, 3), (1, 4, 6)), inside, {"w": ["m"]})) == 1


@settings(max_examples=100, deadline=None)
@given(numel=st.integers(1, 50), owner=st.integers(0, 3), data=st.data())
def test_weight_reads_read_the_window_of_the_whole_weight(numel, owner, data):
    start = data.draw(st.integers(0, numel))
    window = Window(name="fc.weight", start=start, stop=data.draw(st.integers(start, numel)))
    (read,) = weight_reads({"fc.weight": owner}, 4, [window])
    assert (read.file, read.keys) == (rank_file(owner, 4), ("__model__/fc.weight",))
    if window.numel:
        assert (read.start, read.stop, read.at) == (window.start, window.stop, 0)
    else:
        assert (read.numel, read.at) == (0, 0)
    with pytest.raises(ValueError, match="stores no weight of 'b'"):
        weight_reads({"fc.weight": owner}, 4, [Window(name="b", start=0, stop=1)])


def test_dim0_rows_of_a_zero3_device() -> None:
    """A ZeRO-3 save at 4 devices (rows of 2), loaded at 3 (rows of 3): device 1 keeps rows
    [3, 6) of a (7, 2) parameter, elements [6, 12), from ranks 1 and 2's slices."""
    spec = ParamSpec(name="w", shape=(7, 2))
    plan = plan_dim0_shards([spec], [0], shard_size=4)
    reads = state_reads(plan, [Window(name="w", start=6, stop=12)], {"w": ["m"]})
    assert [(r.rank, r.start, r.stop, r.at) for r in reads] == [(1, 2, 4, 0), (2, 0, 4, 2)]
    assert math.prod(spec.shape) == 14


@settings(max_examples=50, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=9),
    count=st.integers(1, 10),
)
def test_hash_shares_hash_every_file_once_in_about_equal_bytes(tmp_path_factory, sizes, count):
    """Each reader of a load hashes its share (``hash_share``): every file by exactly one
    reader, none with more than an equal share plus one file."""
    directory = tmp_path_factory.mktemp("ckpt")
    files = {}
    for rank, size in enumerate(sizes):
        name = rank_file(rank, len(sizes))
        (directory / name).write_bytes(b"x" * size)
        files[name] = "0" * 64
    plan = plan_greedy_shards([], world_size=len(sizes))
    manifest = Manifest(
        framework="jax",
        optimizer="sgd",
        world_size=len(sizes),
        step=0,
        params=(),
        plan=plan,
        state_keys={},
        files=files,
    )
    shares = [hash_share(directory, manifest, i, count) for i in range(count)]
    assert sorted(f for share in shares for f in share) == sorted(files)
    loads = [sum(os.path.getsize(directory / f) for f in share) for share in shares]
    assert max(loads) <= sum(sizes) / count + max(sizes)
    (directory / rank_file(0, len(sizes))).unlink()  # a missing file is still someone's
    again = [hash_share(directory, manifest, i, count) for i in range(count)]
    assert sorted(f for share in again for f in share) == sorted(files)
