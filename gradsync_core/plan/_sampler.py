"""The data position: which samples each step reads, the same at any world size.

See docs/data-position.md.

The rule. Epoch ``e``'s order of the ``dataset_size`` sample indices is a function of
``(seed, epoch, dataset_size)`` only; step after step takes the next ``global_batch_size``
positions of that order (the *global batch*), and rank ``r`` of ``world_size`` takes the
``r``-th contiguous ``global_batch_size / world_size`` of them. So the global batch of a step
does not depend on the world size: 2 ranks, 3 ranks and 1 rank read the same samples per step,
and a position saved at one world size means the same at any other. The position itself is a
``DataCursor``: the epoch and the samples of its order already consumed.

The order is this module's own keyed permutation (below), not Python's ``random``: the
``random`` module promises the same sequence for a seed only within one Python version's
implementation, and ``shuffle`` materialises all ``dataset_size`` indices, whereas a data
position must mean the same thing to every process, every Python, and both frameworks.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._canonical import PLAN_VERSION, check_header

LAST_BATCH = ("drop", "pad")
_MAX_SEED = 2**64
_MAX_EPOCH = 2**64  # the order packs the epoch into 8 bytes (``_Permutation``)
# Luby-Rackoff: four Feistel rounds of a pseudo-random function give a pseudo-random
# permutation; BLAKE2b (RFC 7693) is the round function, personalised so the stream is ours.
_ROUNDS = 4
_PERSON = b"gradsync-order-1"


def _check_int(name: str, value: Any, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


class _Permutation(Sequence[int]):
    """Epoch ``epoch``'s order of ``range(dataset_size)``: ``order[position] -> sample``.

    A 4-round balanced Feistel network on ``2 * half_bits`` bits (the smallest even width
    holding ``dataset_size - 1``), round ``k`` XORing the left half with the first 8 bytes
    (little-endian) of ``blake2b(pack("<QQBQ", seed, epoch, k, right), digest_size=8,
    person=b"gradsync-order-1")`` masked to ``half_bits``; outputs ``>= dataset_size`` are
    walked through the network again (cycle walking), which keeps it a permutation of
    ``range(dataset_size)``. Any position is computed alone, in O(1) memory.
    """

    __slots__ = ("_base", "_half_bits", "_mask", "_size")

    def __init__(self, *, dataset_size: int, seed: int, epoch: int) -> None:
        self._size = dataset_size
        self._half_bits = max(1, ((dataset_size - 1).bit_length() + 1) // 2)
        self._mask = (1 << self._half_bits) - 1
        self._base = hashlib.blake2b(struct.pack("<QQ", seed, epoch), digest_size=8, person=_PERSON)

    def _encrypt(self, value: int) -> int:
        left, right = value >> self._half_bits, value & self._mask
        for round_ in range(_ROUNDS):
            h = self._base.copy()
            h.update(struct.pack("<BQ", round_, right))
            left, right = right, left ^ (int.from_bytes(h.digest(), "little") & self._mask)
        return (left << self._half_bits) | right

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, position: int) -> int:  # type: ignore[override]  # no slices
        if not 0 <= position < self._size:
            raise IndexError(f"position {position} is outside the order of {self._size}")
        value = self._encrypt(position)
        while value >= self._size:
            value = self._encrypt(value)
        return value


@dataclass(frozen=True, slots=True, kw_only=True)
class DataCursor:
    """A data position: ``consumed`` samples of epoch ``epoch``'s order are used.

    ``seed``, ``dataset_size`` and ``shuffle`` name the order the position counts in: the
    order is a function of them, so a cursor means nothing under another one
    (``SamplerPlan.resume`` refuses it). The world size and the batch size are not part of
    it: a cursor saved by 2 ranks resumes at 3, in torch or in JAX.

    Example:
        >>> c = DataCursor(epoch=1, consumed=48, seed=0, dataset_size=100)
        >>> DataCursor.from_json(c.to_json()) == c
        True
    """

    epoch: int
    consumed: int
    seed: int
    dataset_size: int
    shuffle: bool = True

    def __post_init__(self) -> None:
        _check_int("epoch", self.epoch, low=0, high=_MAX_EPOCH)
        _check_int("consumed", self.consumed, low=0)
        _check_int("seed", self.seed, low=0, high=_MAX_SEED)
        _check_int("dataset_size", self.dataset_size, low=1)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {self.shuffle!r}")

    def to_json(self) -> dict[str, Any]:
        """A JSON object (``kind``, ``version`` and the fields), stored in a checkpoint's
        manifest as ``extra["data"]``."""
        return {
            "kind": "data_cursor",
            "version": PLAN_VERSION,
            "epoch": self.epoch,
            "consumed": self.consumed,
            "seed": self.seed,
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> DataCursor:
        """The cursor ``to_json`` wrote (a checkpoint's ``extra["data"]``, a sampler's
        ``state_dict()``).

        Raises:
            ValueError: another kind or version, a field out of range, or a position past
                the end of its epoch (``consumed >= dataset_size``), which no sampler saves:
                ``SamplerPlan.advance`` moves such a position to the next epoch, so a stored
                one was edited or corrupted, and resuming it would skip the rest of an epoch.
        """
        check_header(obj, "data_cursor")
        fields = ("epoch", "consumed", "seed", "dataset_size", "shuffle")
        missing = [f for f in fields if f not in obj]
        if missing:
            raise ValueError(f"data_cursor JSON lacks {missing}: write it with to_json()")
        cursor = cls(**{f: obj[f] for f in fields})
        if cursor.consumed >= cursor.dataset_size:
            raise ValueError(
                f"data cursor consumed {cursor.consumed} is not below its dataset_size "
                f"{cursor.dataset_size}: past the end of its epoch, which no sampler saves; "
                "restore the checkpoint or save again"
            )
        return cursor


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplerPlan:
    """Which samples each step reads: the global order, global batches and rank slices.

    Args:
        dataset_size: samples in the dataset (``len(dataset)``).
        global_batch_size: samples per step over all ranks; a multiple of every world size
            it is run at (each rank takes an equal contiguous slice).
        seed: selects the order, ``0 <= seed < 2**64``; the same on every rank.
        shuffle: ``False``: every epoch reads ``0, 1, 2, ...`` in order.
        last_batch: what the samples after the last full global batch of an epoch do.
            ``"drop"`` (default): they are not read this epoch (each epoch's order differs,
            so others are left out next time); every step has ``global_batch_size`` distinct
            samples. ``"pad"``: the last global batch is filled up with the first samples of
            the epoch's order, as ``DistributedSampler`` pads, so every sample is read each
            epoch and a few twice. A short last batch is not offered: ranks would get unequal
            slices (a mean of rank means then weights samples unequally, and a rank could get
            none at all).

    Raises:
        ValueError: a size below 1, a seed out of range, an unknown ``last_batch``, or a
            global batch larger than the dataset under ``"drop"`` (no step would run).

    Example:
        >>> plan = SamplerPlan(dataset_size=10, global_batch_size=4, seed=0)
        >>> cursor = plan.start()
        >>> len(plan.batch(cursor)), plan.steps_per_epoch
        (4, 2)
        >>> plan.rank_batch(cursor, rank=1, world_size=2) == plan.batch(cursor)[2:]
        True
    """

    dataset_size: int
    global_batch_size: int
    seed: int = 0
    shuffle: bool = True
    last_batch: str = "drop"

    def __post_init__(self) -> None:
        _check_int("dataset_size", self.dataset_size, low=1)
        _check_int("global_batch_size", self.global_batch_size, low=1)
        _check_int("seed", self.seed, low=0, high=_MAX_SEED)
        if not isinstance(self.shuffle, bool):
            raise TypeError(f"shuffle must be a bool, got {self.shuffle!r}")
        if self.last_batch not in LAST_BATCH:
            raise ValueError(f"last_batch must be one of {LAST_BATCH}, got {self.last_batch!r}")
        if self.last_batch == "drop" and self.global_batch_size > self.dataset_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} > dataset_size "
                f"{self.dataset_size} with last_batch='drop': no step would ever run; use a "
                "smaller global batch or last_batch='pad'"
            )

    @property
    def steps_per_epoch(self) -> int:
        """Steps of an epoch started at position 0."""
        return self._steps_left(0)

    def steps_left(self, cursor: DataCursor) -> int:
        """Steps left in ``cursor``'s epoch from ``cursor`` on."""
        return self._steps_left(cursor.consumed)

    def _steps_left(self, consumed: int) -> int:
        left = self.dataset_size - consumed
        if left <= 0:
            return 0
        if self.last_batch == "drop":
            return left // self.global_batch_size
        return math.ceil(left / self.global_batch_size)

    def start(self, epoch: int = 0) -> DataCursor:
        """The position at the start of ``epoch``."""
        return DataCursor(
            epoch=epoch,
            consumed=0,
            seed=self.seed,
            dataset_size=self.dataset_size,
            shuffle=self.shuffle,
        )

    def resume(self, cursor: DataCursor, *, allow_resize: bool = False) -> DataCursor:
        """``cursor``, checked against this plan: where a resumed run continues.

        The world size and the global batch size may differ from the run that saved it (the
        cursor counts samples). The seed and ``shuffle`` may not. A dataset of another size
        is refused unless ``allow_resize``: the order is a function of the size, so the
        position then continues in a new order (the rest of that epoch may repeat or skip
        samples; every later epoch is a permutation again). A position with no full step
        left in its epoch moves to the next epoch.

        Raises:
            ValueError: the cursor was saved for another seed, shuffle or dataset size.
        """
        for name in ("seed", "shuffle"):
            if getattr(cursor, name) != getattr(self, name):
                raise ValueError(
                    f"the data cursor was saved with {name}={getattr(cursor, name)!r} but this "
                    f"sampler has {name}={getattr(self, name)!r}: the order depends on it, so "
                    f"build the sampler with {name}={getattr(cursor, name)!r}"
                )
        if cursor.dataset_size != self.dataset_size and not allow_resize:
            raise ValueError(
                f"the data cursor was saved for a dataset of {cursor.dataset_size} samples but "
                f"this one has {self.dataset_size}: the order is a function of the size, so the "
                "saved position does not exist in it; restore the dataset, or pass "
                "allow_resize=True to continue the same epoch at the same sample count in the "
                "new order"
            )
        moved = DataCursor(
            epoch=cursor.epoch,
            consumed=cursor.consumed,
            seed=self.seed,
            dataset_size=self.dataset_size,
            shuffle=self.shuffle,
        )
        return self.advance(moved, 0)

    def advance(self, cursor: DataCursor, steps: int = 1) -> DataCursor:
        """The position ``steps`` global batches after ``cursor`` (crossing epochs).

        A global batch never straddles two epochs: when fewer samples are left than a step
        takes (``"drop"``) or none (``"pad"``), the next step starts the next epoch.
        """
        _check_int("steps", steps, low=0)
        epoch, consumed = cursor.epoch, cursor.consumed
        left = self._steps_left(consumed)
        if steps < left:
            consumed += steps * self.global_batch_size
        else:
            steps -= left
            per_epoch = self.steps_per_epoch
            epoch += 1 + steps // per_epoch
            consumed = (steps % per_epoch) * self.global_batch_size
        return DataCursor(
            epoch=epoch,
            consumed=consumed,
            seed=cursor.seed,
            dataset_size=cursor.dataset_size,
            shuffle=cursor.shuffle,
        )

    def order(self, epoch: int) -> Sequence[int]:
        """Epoch ``epoch``'s order: ``order[position]`` is a sample index (a permutation of
        ``range(dataset_size)``; ``range`` itself when ``shuffle`` is off)."""
        _check_int("epoch", epoch, low=0, high=_MAX_EPOCH)
        if not self.shuffle:
            return range(self.dataset_size)
        return _Permutation(dataset_size=self.dataset_size, seed=self.seed, epoch=epoch)

    def batch(self, cursor: DataCursor) -> tuple[int, ...]:
        """The global batch of the step at ``cursor`` (all ranks' samples, in rank order)."""
        return self.rank_batch(cursor, rank=0, world_size=1)

    def rank_batch(self, cursor: DataCursor, *, rank: int, world_size: int) -> tuple[int, ...]:
        """Rank ``rank``'s contiguous slice of the global batch at ``cursor``.

        Raises:
            ValueError: ``global_batch_size`` is not a multiple of ``world_size``, ``rank`` is
                out of range, or ``cursor`` is not at a step of this plan (``resume`` it).
        """
        start, stop = self.rank_span(rank=rank, world_size=world_size)
        cursor = self._check_at_step(cursor)
        order = self.order(cursor.epoch)
        return tuple(order[(cursor.consumed + p) % self.dataset_size] for p in range(start, stop))

    def rank_span(self, *, rank: int, world_size: int) -> tuple[int, int]:
        """``(start, stop)``: rank ``rank``'s positions inside a global batch."""
        _check_int("world_size", world_size, low=1)
        _check_int("rank", rank, low=0, high=world_size)
        if self.global_batch_size % world_size:
            raise ValueError(
                f"global_batch_size {self.global_batch_size} is not a multiple of world_size "
                f"{world_size}: every rank reads an equal contiguous slice of the global "
                "batch; choose a global batch that every world size you run at divides"
            )
        per_rank = self.global_batch_size // world_size
        return rank * per_rank, (rank + 1) * per_rank

    def _check_at_step(self, cursor: DataCursor) -> DataCursor:
        same = (cursor.seed, cursor.dataset_size, cursor.shuffle)
        if same != (self.seed, self.dataset_size, self.shuffle) or not self._steps_left(
            cursor.consumed
        ):
            raise ValueError(
                f"cursor {cursor} is not a step position of this plan: pass a saved cursor "
                "through SamplerPlan.resume first"
            )
        return cursor

    def rank_batches(
        self, cursor: DataCursor, *, rank: int, world_size: int
    ) -> Iterator[tuple[tuple[int, ...], DataCursor]]:
        """Endless ``(rank's indices, position after this step)`` from ``cursor`` on."""
        while True:
            indices = self.rank_batch(cursor, rank=rank, world_size=world_size)
            cursor = self.advance(cursor)
            yield indices, cursor
