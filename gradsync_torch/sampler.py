"""``ResumableSampler``: ``DistributedSampler`` with a position that survives a new world size.

See docs/data-position.md.

Which samples a step reads is ``gradsync_core.SamplerPlan``'s rule: the next global batch of
the epoch's order, rank ``r`` taking the ``r``-th contiguous slice. This file only walks that
plan for one rank and counts what the ``DataLoader`` drew, so ``state_dict()`` is a
``gradsync_core.DataCursor`` that any world size, and ``gradsync_jax.ResumableSampler``,
resumes from.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sized
from typing import Any

import torch.distributed as dist
from torch.utils.data import Sampler

from gradsync_core import DataCursor, SamplerPlan


class ResumableSampler(Sampler[int]):
    """A drop-in for ``torch.utils.data.distributed.DistributedSampler`` with a data position.

    Every step reads the next ``global_batch_size`` samples of the epoch's order (a function of
    ``seed``, the epoch and ``len(dataset)`` only); this rank yields its contiguous
    ``global_batch_size // num_replicas`` of them (``self.batch_size``, the ``DataLoader``'s
    ``batch_size``). So 1, 2 or 3 ranks read the same samples per step, and
    ``state_dict()`` saved at one world size resumes at any other.

    Args:
        dataset: anything with ``len``.
        num_replicas, rank: default the default process group's world size and rank.
        shuffle, seed: as in ``DistributedSampler``; ``seed`` must be the same on all ranks.
        global_batch_size: samples per step over all ranks (keyword).
        last_batch: ``"drop"`` (default) or ``"pad"``: see ``gradsync_core.SamplerPlan``.
        drop_last: ``DistributedSampler``'s spelling: ``True`` is ``"drop"``, ``False``
            ``"pad"``; give it or ``last_batch``, not both.
        allow_resize: let ``load_state_dict`` take a position saved for a dataset of another
            size (``SamplerPlan.resume``).

    Raises:
        ValueError: as ``SamplerPlan``; ``global_batch_size`` not a multiple of
            ``num_replicas``.

    Example::

        sampler = ResumableSampler(dataset, global_batch_size=64)
        loader = DataLoader(dataset, batch_size=sampler.batch_size, sampler=sampler)
        for epoch in itertools.count(sampler.epoch):  # a resumed run starts mid-epoch
            sampler.set_epoch(epoch)
            for x, y in loader: ...
            json.dump(sampler.state_dict(), f)  # beside the checkpoint
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool | None = None,
        *,
        global_batch_size: int,
        last_batch: str | None = None,
        allow_resize: bool = False,
    ) -> None:
        if drop_last is not None and last_batch is not None:
            raise ValueError(
                f"drop_last={drop_last} and last_batch={last_batch!r} both given: pass one "
                "(drop_last=True is last_batch='drop', False is 'pad')"
            )
        if last_batch is None:
            last_batch = "drop" if drop_last in (None, True) else "pad"
        if num_replicas is None or rank is None:
            if not dist.is_initialized():
                raise RuntimeError(
                    "ResumableSampler needs num_replicas and rank, or an initialized default "
                    "process group to take them from"
                )
            num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
            rank = dist.get_rank() if rank is None else rank
        self.dataset = dataset
        self.num_replicas, self.rank = num_replicas, rank
        self.shuffle, self.seed, self.allow_resize = shuffle, seed, allow_resize
        self.plan = SamplerPlan(
            dataset_size=len(dataset),
            global_batch_size=global_batch_size,
            seed=seed,
            shuffle=shuffle,
            last_batch=last_batch,
        )
        start, stop = self.plan.rank_span(rank=rank, world_size=num_replicas)
        self.batch_size = stop - start
        self._cursor = self.plan.start()  # where the running (or next) iteration started
        self._drawn = 0  # indices the running iteration has handed out

    def cursor(self) -> DataCursor:
        """The position after the steps whose indices were drawn (whole per-rank batches)."""
        return self.plan.advance(self._cursor, self._drawn // self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch the next step reads from."""
        return self.cursor().epoch

    def set_epoch(self, epoch: int) -> None:
        """Start ``epoch`` from its beginning, unless the position is already inside it (as
        after ``load_state_dict``, or after the previous epoch ran to its end)."""
        if self.cursor().epoch != epoch:
            self._cursor, self._drawn = self.plan.start(epoch), 0

    def __iter__(self) -> Iterator[int]:
        start = self._cursor = self.cursor()
        self._drawn = 0
        cursor = start
        while cursor.epoch == start.epoch:
            indices = self.plan.rank_batch(cursor, rank=self.rank, world_size=self.num_replicas)
            cursor = self.plan.advance(cursor)
            for index in indices:
                # Counted before it is handed out: once the DataLoader holds a step's batch,
                # the position already includes it.
                self._drawn += 1
                yield index

    def __len__(self) -> int:
        """This rank's samples left in the current epoch (all of it at an epoch's start)."""
        return self.plan.steps_left(self.cursor()) * self.batch_size

    def state_dict(self) -> dict[str, Any]:
        """The position as ``DataCursor.to_json()``: the same on every rank.

        Exact with ``num_workers=0`` and with ``torchdata``'s ``StatefulDataLoader``. A plain
        ``DataLoader`` with worker processes draws ``prefetch_factor * num_workers`` batches
        of indices ahead of the loop; there use ``state_at(steps)``.
        """
        return self.cursor().to_json()

    def state_at(self, steps: int) -> dict[str, Any]:
        """The position after ``steps`` steps of the running iteration (or from the current
        position, when none runs), whatever the loader drew ahead."""
        return self.plan.advance(self._cursor, steps).to_json()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continue at the position ``state_dict()`` returned, saved at any world size.

        Raises:
            ValueError: it was saved with another seed, ``shuffle`` or dataset size (unless
                ``allow_resize``), or is not a data cursor.
        """
        self._cursor = self.plan.resume(DataCursor.from_json(state), allow_resize=self.allow_resize)
        self._drawn = 0
