"""gradsync_jax.ResumableSampler: each process's indices per step, feeding
``jax.make_array_from_process_local_data`` (docs/data-position.md)."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import DataCursor, SamplerPlan, Topology
from gradsync_jax import ResumableSampler, mesh_from_topology


def steps(sampler: ResumableSampler, n: int) -> list[list[int]]:
    return [a.tolist() for a in itertools.islice(sampler, n)]


def test_processes_read_contiguous_slices_of_the_global_batch() -> None:
    plan = SamplerPlan(dataset_size=50, global_batch_size=12, seed=9)
    one = ResumableSampler(50, global_batch_size=12, seed=9)
    assert (one.process_index, one.process_count, one.batch_size) == (0, 1, 12)
    want = steps(one, 9)  # 4 steps an epoch: crosses two epochs
    cursor = plan.start()
    for batch in want:
        assert tuple(batch) == plan.batch(cursor)
        cursor = plan.advance(cursor)
    assert one.cursor() == cursor and one.epoch == 2
    parts = [
        steps(
            ResumableSampler(50, global_batch_size=12, seed=9, process_index=p, process_count=3), 9
        )
        for p in range(3)
    ]
    assert [a + b + c for a, b, c in zip(*parts, strict=True)] == want


def test_a_position_from_another_world_size_resumes() -> None:
    want = steps(ResumableSampler(50, global_batch_size=12, last_batch="pad", seed=9), 10)
    first = [
        ResumableSampler(
            50, global_batch_size=12, last_batch="pad", seed=9, process_index=p, process_count=4
        )
        for p in range(4)
    ]
    got = [
        [i for part in parts for i in part]
        for parts in zip(*(steps(s, 6) for s in first), strict=True)
    ]
    state = first[0].state_dict()
    assert all(s.state_dict() == state for s in first)
    assert DataCursor.from_json(state) == DataCursor(epoch=1, consumed=12, seed=9, dataset_size=50)
    resumed = ResumableSampler(50, global_batch_size=12, last_batch="pad", seed=9)
    resumed.load_state_dict(state)
    assert got + steps(resumed, 4) == want


def test_indices_feed_make_array_from_process_local_data() -> None:
    devices = sorted(jax.devices(), key=lambda d: d.id)[:4]
    mesh = mesh_from_topology(Topology.create(4), devices)
    sharding = NamedSharding(mesh, P("dp"))
    x = np.arange(50 * 3, dtype=np.float32).reshape(50, 3)
    sampler = ResumableSampler(len(x), global_batch_size=12, seed=9)
    indices = next(sampler)
    assert indices.dtype == np.int64 and indices.shape == (12,)
    batch = jax.make_array_from_process_local_data(sharding, x[indices])
    assert batch.shape == (12, 3)
    np.testing.assert_array_equal(np.asarray(batch), x[indices])
    for shard in batch.addressable_shards:  # device i of dp holds rows 3i .. 3i+2
        np.testing.assert_array_equal(np.asarray(shard.data), x[indices][shard.index])


def test_bad_arguments_and_positions_are_refused() -> None:
    with pytest.raises(ValueError, match="not a multiple of world_size 5"):
        ResumableSampler(50, global_batch_size=12, process_index=0, process_count=5)
    saved = ResumableSampler(50, global_batch_size=12).state_dict()
    with pytest.raises(ValueError, match="dataset of 50 samples but this one has 40"):
        ResumableSampler(40, global_batch_size=12).load_state_dict(saved)
    with pytest.raises(ValueError, match="expected a JSON object"):
        ResumableSampler(50, global_batch_size=12).load_state_dict([1, 2])
    resized = ResumableSampler(40, global_batch_size=12, allow_resize=True)
    resized.load_state_dict(saved)
    assert resized.cursor() == resized.plan.start()
