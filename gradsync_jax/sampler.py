"""``ResumableSampler``: this process's sample indices for each step, at any process count.

At a data position that survives a change of process or device count (docs/data-position.md).

The rule is ``gradsync_core.SamplerPlan``'s: each step reads the next global batch of the
epoch's order, process ``p`` of ``P`` taking the ``p``-th contiguous slice, which is what
``jax.make_array_from_process_local_data`` expects of a batch sharded over the data-parallel
axis when every process's devices are consecutive along it. The position is the same
``gradsync_core.DataCursor`` that ``gradsync_torch.ResumableSampler`` saves.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np

from gradsync_core import DataCursor, SamplerPlan


class ResumableSampler:
    """An endless iterator of this process's sample indices, one array per step.

    Args:
        dataset_size: samples in the dataset.
        global_batch_size: samples per step over all processes (keyword).
        seed, shuffle, last_batch: the order and the end of an epoch
            (``gradsync_core.SamplerPlan``); ``seed`` the same in every process.
        process_index, process_count: default ``jax.process_index()`` /
            ``jax.process_count()``.
        allow_resize: let ``load_state_dict`` take a position saved for a dataset of another
            size (``SamplerPlan.resume``).

    Raises:
        ValueError: as ``SamplerPlan``; ``global_batch_size`` not a multiple of
            ``process_count``.

    Example::

        sampler = ResumableSampler(len(x), global_batch_size=64)
        sharding = NamedSharding(mesh, P("dp"))
        for step, indices in zip(range(steps), sampler):
            batch = jax.make_array_from_process_local_data(sharding, x[indices])
            ...
        json.dump(sampler.state_dict(), f)  # beside the checkpoint
    """

    def __init__(
        self,
        dataset_size: int,
        *,
        global_batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        last_batch: str = "drop",
        process_index: int | None = None,
        process_count: int | None = None,
        allow_resize: bool = False,
    ) -> None:
        self.plan = SamplerPlan(
            dataset_size=dataset_size,
            global_batch_size=global_batch_size,
            seed=seed,
            shuffle=shuffle,
            last_batch=last_batch,
        )
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        start, stop = self.plan.rank_span(rank=self.process_index, world_size=self.process_count)
        self.batch_size = stop - start  # this process's rows of each global batch
        self.allow_resize = allow_resize
        self._cursor = self.plan.start()

    def cursor(self) -> DataCursor:
        """The position after the steps already yielded."""
        return self._cursor

    @property
    def epoch(self) -> int:
        """The epoch the next step reads from."""
        return self._cursor.epoch

    def __iter__(self) -> Iterator[np.ndarray]:
        return self

    def __next__(self) -> np.ndarray:
        """This process's indices of the next step (``int64``, ``batch_size`` of them)."""
        indices = self.plan.rank_batch(
            self._cursor, rank=self.process_index, world_size=self.process_count
        )
        self._cursor = self.plan.advance(self._cursor)
        return np.asarray(indices, dtype=np.int64)

    def state_dict(self) -> dict[str, Any]:
        """The position as ``DataCursor.to_json()``: the same in every process."""
        return self._cursor.to_json()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at a position saved by either framework at any world size.

        Raises:
            ValueError: it was saved with another seed, ``shuffle`` or dataset size (unless
                ``allow_resize``), or is not a data cursor.
        """
        self._cursor = self.plan.resume(DataCursor.from_json(state), allow_resize=self.allow_resize)
