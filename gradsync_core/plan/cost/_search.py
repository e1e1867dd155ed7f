"""The search: every configuration of a world, those that fit in memory ranked by step time.

``search_configurations`` enumerates ZeRO stages, bucket caps, ``reshard_after_forward``,
HSDP's shard-group sizes and pipeline splits with their schedules and microbatches, plans and
costs each with ``predict`` and keeps those whose fullest rank fits ``memory_per_rank``,
fastest first (``rank_key``: ties, to the nanosecond, go to less memory, then to the
enumeration order). Every configuration left out is
kept with the sentence that says why (it does not fit, its batch does not split, a planner
refused it), so the answer to "why not ZeRO-1?" is in the result. A training script can take
``result.best``: its plans are the ones that were costed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._buckets import MIB
from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan.cost._machine import MachineProfile
from gradsync_core.plan.cost._model_profile import ModelProfile
from gradsync_core.plan.cost._predict import Configuration, Prediction, predict

GIB = 1024 * MIB
DEFAULT_BUCKET_CAPS_MB: tuple[float | None, ...] = (None, 1.0, 4.0, 25.0, 100.0)
DEFAULT_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
TIE_DIGITS = 9  # step times equal to the nanosecond are ties


def rank_key(step_s: float, peak_bytes: int, order: int) -> tuple[float, int, int]:
    """How the search orders predictions: the faster step, then the lower peak, then the
    earlier candidate. Step times are compared to the nanosecond: two configurations whose
    timelines are the same (DDP with and without overlap when one bucket holds every
    gradient) differ only by float rounding, and that must not pick one over the other.

    Example:
        >>> rank_key(0.03705396391287421, 100, 0) == rank_key(0.0370539639128742, 100, 0)
        True
        >>> sorted([rank_key(0.0370539639128742, 100, 1), rank_key(0.03705396391287421, 100, 0)])
        [(0.037053964, 100, 0), (0.037053964, 100, 1)]
    """
    return (round(step_s, TIE_DIGITS), peak_bytes, order)


@dataclass(frozen=True, slots=True, kw_only=True)
class Dropped:
    """A configuration the search left out, and the sentence that says why."""

    configuration: Configuration
    reason: str

    def to_json(self) -> dict[str, Any]:
        return {
            "configuration": self.configuration.to_json(),
            "label": self.configuration.describe(),
            "reason": self.reason,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class SearchResult:
    """The configurations that fit, fastest first, and those dropped with their reasons."""

    ranked: tuple[Prediction, ...]
    dropped: tuple[Dropped, ...]
    world_size: int
    memory_per_rank: int | None
    global_batch: int

    @property
    def best(self) -> Prediction:
        """The fastest configuration that fits.

        Raises:
            ValueError: none fits; the sentence gives the closest miss.
        """
        if not self.ranked:
            reasons = "; ".join(
                f"{d.configuration.describe()}: {d.reason}" for d in self.dropped[:3]
            )
            raise ValueError(f"no configuration fits: {reasons or 'none was enumerated'}")
        return self.ranked[0]

    def to_json(self, top: int | None = None) -> dict[str, Any]:
        return {
            "kind": "cost_search",
            "version": 1,
            "world_size": self.world_size,
            "memory_per_rank": self.memory_per_rank,
            "global_batch": self.global_batch,
            "ranked": [p.to_json() for p in self.ranked[:top]],
            "dropped": [d.to_json() for d in self.dropped],
        }


def _size(nbytes: int) -> str:
    return f"{nbytes / GIB:,.2f} GiB" if nbytes >= GIB else f"{nbytes / MIB:,.2f} MiB"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def configurations(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    zero: Sequence[int] = (0, 1, 2, 3),
    bucket_caps_mb: Sequence[float | None] = DEFAULT_BUCKET_CAPS_MB,
    reshard_after_forward: Sequence[bool] = (True, False),
    dp_shards: Sequence[int] | None = None,
    pp: Sequence[int] | None = None,
    schedules: Sequence[str] = DEFAULT_SCHEDULES,
    microbatches: Sequence[int] | None = None,
    overlap: Sequence[bool] = (True,),
    param_sync: str = "broadcast",
) -> list[Configuration]:
    """Every configuration the search costs, in a fixed order.

    Data parallelism over the whole world: each ZeRO stage 0-2 at each bucket cap (and each
    ``overlap``); ZeRO-3 with each ``reshard_after_forward`` and each HSDP shard-group size
    (``dp_shards``, default every divisor of the world from 2; the whole world is plain FSDP).
    Pipelines: each ``pp`` (default the divisors of the world from 2 up to the number of
    blocks) with each schedule and microbatch count (default pp, 2 pp and 4 pp), ZeRO-0 over
    the rest of the world.
    """
    out: list[Configuration] = []
    for stage in zero:
        if stage == 3:
            shards = [d for d in _divisors(world_size) if d > 1] or [1]
            for shard in dp_shards if dp_shards is not None else shards:
                for raf in reshard_after_forward:
                    for ov in overlap:
                        out.append(
                            Configuration(
                                zero=3,
                                dp_shard=None if shard == world_size else shard,
                                reshard_after_forward=raf,
                                overlap=ov,
                            )
                        )
            continue
        for cap in bucket_caps_mb:
            for ov in overlap:
                sync = param_sync if stage == 2 else "broadcast"
                out.append(
                    Configuration(zero=stage, bucket_cap_mb=cap, overlap=ov, param_sync=sync)
                )
    layers = len(block_prefixes(specs))
    sizes = pp if pp is not None else [d for d in _divisors(world_size) if 1 < d <= layers]
    for size in sizes:
        for schedule in schedules:
            for m in microbatches if microbatches is not None else (size, 2 * size, 4 * size):
                out.append(Configuration(pp=size, schedule=schedule, microbatches=m))
    return out


def search_configurations(
    specs: Sequence[ParamSpec],
    *,
    world_size: int,
    machine: MachineProfile,
    model: ModelProfile,
    memory_per_rank: int | None = None,
    global_batch: int | None = None,
    optimizer: str | int = "adam",
    tied: Sequence[str] = (),
    candidates: Sequence[Configuration] | None = None,
    executor: str = "torch",
) -> SearchResult:
    """Cost every configuration and rank those that fit.

    Args:
        specs: the model's parameters.
        world_size: ranks.
        machine: the machine profile.
        model: the model profile.
        memory_per_rank: bytes a rank may hold (None: no limit).
        global_batch: samples per step over the world, the same for every configuration
            (default: the model profile's samples on every rank).
        optimizer: the optimizer's state bytes per element.
        tied: parameters used twice (ZeRO-3's memory).
        candidates: the configurations to cost (default ``configurations(specs,
            world_size=world_size)``).
        executor: whose steps run, ``"torch"`` or ``"jax"`` (``predict``'s).

    Returns:
        The ranked predictions and the dropped configurations with their reasons.

    Example:
        >>> from gradsync_core.plan import LinkCost, MachineProfile, ModelProfile, BlockTime
        >>> machine = MachineProfile(name="toy", ranks_per_node=8, links=tuple(
        ...     LinkCost(collective=c, group_size=None, latency_s=1e-5, bus_bandwidth=1e10)
        ...     for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")))
        >>> specs = [ParamSpec(name=f"layers.{i}.weight", shape=(1024, 1024)) for i in range(8)]
        >>> model = ModelProfile(samples=8, source="given", blocks=tuple(
        ...     BlockTime(prefix=f"layers.{i}", forward_s=1e-3, backward_s=2e-3)
        ...     for i in range(8)))
        >>> result = search_configurations(specs, world_size=4, machine=machine, model=model,
        ...                                memory_per_rank=100 * 2**20)
        >>> result.best.peak_bytes <= 100 * 2**20, len(result.ranked) + len(result.dropped) > 20
        (True, True)
    """
    if memory_per_rank is not None and (
        not isinstance(memory_per_rank, int) or memory_per_rank < 1
    ):
        raise ValueError(
            f"memory_per_rank must be a positive int of bytes, got {memory_per_rank!r}"
        )
    batch = model.samples * world_size if global_batch is None else global_batch
    todo = configurations(specs, world_size=world_size) if candidates is None else candidates
    ranked: list[tuple[float, int, int, Prediction]] = []
    dropped: list[Dropped] = []
    for order, config in enumerate(todo):
        try:
            p = predict(
                specs,
                config,
                world_size=world_size,
                machine=machine,
                model=model,
                global_batch=batch,
                optimizer=optimizer,
                tied=tied,
                executor=executor,
            )
        except ValueError as err:
            dropped.append(Dropped(configuration=config, reason=str(err)))
            continue
        if memory_per_rank is not None and p.peak_bytes > memory_per_rank:
            dropped.append(
                Dropped(
                    configuration=config,
                    reason=f"peak {_size(p.peak_bytes)} on its fullest rank is over the "
                    f"{_size(memory_per_rank)} per rank",
                )
            )
            continue
        ranked.append((*rank_key(p.step_s, p.peak_bytes, order), p))
    ranked.sort(key=lambda item: item[:3])
    return SearchResult(
        ranked=tuple(p for *_, p in ranked),
        dropped=tuple(dropped),
        world_size=world_size,
        memory_per_rank=memory_per_rank,
        global_batch=batch,
    )
