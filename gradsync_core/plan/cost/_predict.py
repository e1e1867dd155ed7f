"""One configuration, planned as the executors plan it and costed: ``predict``.

A ``Configuration`` says how a step runs (ZeRO stage, bucket cap, overlap,
``reshard_after_forward``, HSDP's shard group, pipeline size, schedule and microbatches);
``predict`` builds the plans the executors would build for it: ``plan_buckets`` with DDP's cap
convention (rebuilt from the gradient-ready order, as DDP rebuilds after its first step; the
explicit sync's legacy layout without overlap), ``plan_greedy_shards`` / ``plan_flat_shards``,
``plan_param_shards`` over ``block_prefixes``, ``plan_pipeline``; and costs exactly those, so
the plan a training script takes from a ``Prediction`` is byte for byte the one that was costed
(its fingerprints are in the prediction).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._buckets import (
    BucketPlan,
    bucket_caps,
    legacy_max_numel,
    plan_buckets,
    plan_legacy_buckets,
    rebuild_buckets,
)
from gradsync_core.plan._param_shards import ParamShardPlan, plan_param_shards
from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._shards import ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.cost._data_parallel_cost import PARAM_SYNCS, predict_data_parallel
from gradsync_core.plan.cost._machine import MachineProfile
from gradsync_core.plan.cost._model_profile import ModelProfile
from gradsync_core.plan.cost._pipeline_cost import predict_pipeline
from gradsync_core.plan.cost._timeline import StepCost
from gradsync_core.plan.cost._zero3_cost import EXECUTORS, predict_zero3
from gradsync_core.plan.pipeline._plan import PipelinePlan, plan_pipeline
from gradsync_core.plan.pipeline._schedules import schedule_name


@dataclass(frozen=True, slots=True, kw_only=True)
class Configuration:
    """How one training step runs, in the executors' own parameters.

    ``zero``: 0 (``DataParallel``, DDP), 1 (+ ``ZeroRedundancyOptimizer``), 2 (+ gradient
    sharding), 3 (``fully_shard``; with ``dp_shard`` below dp, HSDP). ``bucket_cap_mb``: None
    is DDP's default (25 MiB, the first bucket 1 MiB). ``overlap``: reduce during the
    backward. ``param_sync``: ZeRO-1/2's parameter sync, ``"broadcast"`` (torch) or
    ``"all_gather"`` (JAX's flat ``shard_optimizer``). ``pp``, ``schedule`` and
    ``microbatches``: a pipeline (``pp > 1``), data-parallel over the rest of the world.
    """

    zero: int = 0
    bucket_cap_mb: float | None = None
    overlap: bool = True
    reshard_after_forward: bool = True
    dp_shard: int | None = None
    pp: int = 1
    schedule: str | None = None
    microbatches: int = 1
    param_sync: str = "broadcast"

    def __post_init__(self) -> None:
        if self.zero not in (0, 1, 2, 3):
            raise ValueError(f"zero must be 0, 1, 2 or 3, got {self.zero!r}")
        cap = self.bucket_cap_mb
        if cap is not None and not (
            isinstance(cap, int | float) and math.isfinite(cap) and cap > 0
        ):
            raise ValueError(f"bucket_cap_mb must be a positive number or None, got {cap!r}")
        if self.param_sync not in PARAM_SYNCS:
            raise ValueError(f"param_sync must be one of {PARAM_SYNCS}, got {self.param_sync!r}")
        for name in ("pp", "microbatches"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.pp > 1:
            if self.schedule is None:
                raise ValueError("a pipeline (pp > 1) needs a schedule, e.g. schedule='1F1B'")
            object.__setattr__(self, "schedule", schedule_name(self.schedule))
            if self.zero:
                raise ValueError(
                    "the cost of ZeRO inside pipeline stages is not modeled; use zero=0 with pp > 1"
                )
        elif self.schedule is not None or self.microbatches != 1:
            raise ValueError(
                "schedule and microbatches apply to a pipeline only (pp > 1); leave them unset"
            )
        if self.param_sync == "all_gather" and self.zero != 2:
            raise ValueError(
                "param_sync='all_gather' is the flat shard_optimizer's sync, which shards "
                "gradients too: use it with zero=2"
            )
        if self.dp_shard is not None and self.zero != 3:
            raise ValueError("dp_shard (HSDP) applies to zero=3 only")

    def describe(self) -> str:
        """A short label: ``zero3 hsdp 2x2 raf``, ``ddp cap 25 overlap``, ``pp2 1F1B m8``."""
        if self.pp > 1:
            return f"pp{self.pp} {self.schedule} m{self.microbatches}"
        if self.zero == 3:
            shard = "" if self.dp_shard is None else f" shard {self.dp_shard}"
            raf = "reshard" if self.reshard_after_forward else "keep"
            return f"zero3{shard} {raf}" + ("" if self.overlap else " no-overlap")
        cap = "default cap" if self.bucket_cap_mb is None else f"cap {self.bucket_cap_mb:g} MiB"
        name = "ddp" if self.zero == 0 else f"zero{self.zero}"
        sync = " all-gather" if self.zero and self.param_sync == "all_gather" else ""
        return f"{name} {cap}{sync}" + ("" if self.overlap else " no-overlap")

    def to_json(self) -> dict[str, Any]:
        return {
            "zero": self.zero,
            "bucket_cap_mb": self.bucket_cap_mb,
            "overlap": self.overlap,
            "reshard_after_forward": self.reshard_after_forward,
            "dp_shard": self.dp_shard,
            "pp": self.pp,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "param_sync": self.param_sync,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Prediction:
    """A configuration, the plans it runs and their predicted cost.

    Exactly one group of plans is set: ``buckets`` (and ``shards`` for ZeRO-1/2),
    ``param_shards`` (ZeRO-3) or ``pipeline``.
    """

    configuration: Configuration
    topology: Topology
    samples: int  # per rank and microbatch
    cost: StepCost
    buckets: BucketPlan | None = None
    shards: ShardPlan | None = None
    param_shards: ParamShardPlan | None = None
    pipeline: PipelinePlan | None = None

    @property
    def step_s(self) -> float:
        return self.cost.step_s

    @property
    def peak_bytes(self) -> int:
        return self.cost.peak_bytes

    @property
    def fingerprints(self) -> dict[str, str]:
        """The fingerprint of every plan the prediction costed, and of the topology."""
        plans = {
            "buckets": self.buckets,
            "shards": self.shards,
            "param_shards": self.param_shards,
            "pipeline": self.pipeline,
        }
        out = {name: plan.fingerprint for name, plan in plans.items() if plan is not None}
        return out | {"topology": self.topology.fingerprint}

    def to_json(self) -> dict[str, Any]:
        return {
            "configuration": self.configuration.to_json(),
            "label": self.configuration.describe(),
            "topology": self.topology.to_json(),
            "samples": self.samples,
            "cost": self.cost.to_json(),
            "fingerprints": self.fingerprints,
        }


def ready_order(specs: Sequence[ParamSpec], model: ModelProfile) -> list[str]:
    """The order the backward makes the gradients ready, as the model profile has it: the
    blocks last to first, in each the parameters in reverse registration order."""
    trainable = [(i, s) for i, s in enumerate(specs) if s.requires_grad]
    ordered = sorted(trainable, key=lambda item: (-model.block_of(item[1].name), -item[0]))
    return [s.name for _, s in ordered]


def predict(
    specs: Sequence[ParamSpec],
    configuration: Configuration,
    *,
    world_size: int,
    machine: MachineProfile,
    model: ModelProfile,
    global_batch: int | None = None,
    optimizer: str | int = "adam",
    units: Sequence[str] | None = None,
    tied: Sequence[str] = (),
    executor: str = "torch",
) -> Prediction:
    """Plan ``configuration`` over ``world_size`` ranks as the executors do, and cost it.

    Args:
        specs: the model's parameters.
        configuration: how the step runs.
        world_size: ranks; data parallelism takes what the pipeline leaves.
        machine: the machine profile.
        model: the model profile.
        global_batch: samples per step over all ranks (default: the model profile's samples
            on every data-parallel rank and microbatch).
        optimizer: the optimizer's state bytes per element (``optimizer_state_bytes``).
        units: ZeRO-3's unit prefixes (default ``block_prefixes(specs)``).
        tied: parameters used twice (ZeRO-3's memory).
        executor: whose step runs, ``"torch"`` or ``"jax"``: ZeRO-3's peak differs (one XLA
            program holds its buffers as its schedule reads them; ``predict_zero3``), and
            JAX packs ZeRO-2's buckets at the machine's ``pack_s`` and DDP's not at all
            (``predict_data_parallel``).

    Returns:
        The prediction: the plans, their fingerprints and the cost.

    Raises:
        ValueError: a world the configuration does not divide, a global batch that does not
            split into whole microbatches, an unknown executor, or what a planner or the cost
            model refuses.

    Example:
        >>> from gradsync_core.plan import LinkCost, MachineProfile, ModelProfile, BlockTime
        >>> machine = MachineProfile(name="toy", ranks_per_node=8, links=tuple(
        ...     LinkCost(collective=c, group_size=None, latency_s=1e-5, bus_bandwidth=1e10)
        ...     for c in ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p")))
        >>> specs = [ParamSpec(name=f"layers.{i}.weight", shape=(512, 512)) for i in range(4)]
        >>> model = ModelProfile(samples=8, source="given", blocks=tuple(
        ...     BlockTime(prefix=f"layers.{i}", forward_s=1e-3, backward_s=2e-3)
        ...     for i in range(4)))
        >>> p = predict(specs, Configuration(zero=3), world_size=4, machine=machine,
        ...             model=model)
        >>> p.configuration.describe(), p.step_s > 0.012
        ('zero3 reshard', True)
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}; pick one")
    c = configuration
    topology = Topology.create(world_size, pp=c.pp, dp_shard=c.dp_shard)
    dp = topology.dp
    batch = model.samples * dp * c.microbatches if global_batch is None else global_batch
    if not isinstance(batch, int) or batch < 1 or batch % (dp * c.microbatches):
        raise ValueError(
            f"a global batch of {batch!r} samples does not split over dp {dp} x "
            f"{c.microbatches} microbatches; pick a multiple of {dp * c.microbatches}"
        )
    samples = batch // (dp * c.microbatches)
    cap, first = bucket_caps(c.bucket_cap_mb)
    if c.pp > 1:
        assert c.schedule is not None
        pipeline = plan_pipeline(
            schedule=c.schedule, microbatches=c.microbatches, topology=topology, specs=specs
        )
        cost = predict_pipeline(
            pipeline,
            specs,
            machine=machine,
            model=model,
            optimizer=optimizer,
            samples=samples,
            bucket_cap_mb=c.bucket_cap_mb,
        )
        return Prediction(
            configuration=c, topology=topology, samples=samples, cost=cost, pipeline=pipeline
        )
    if c.zero == 3:
        plan = plan_param_shards(
            specs,
            world_size=dp,
            units=block_prefixes(specs) if units is None else units,
            dp_shard=c.dp_shard,
        )
        cost = predict_zero3(
            plan,
            machine=machine,
            model=model,
            topology=topology,
            reshard_after_forward=c.reshard_after_forward,
            overlap=c.overlap,
            optimizer=optimizer,
            samples=samples,
            tied=tied,
            executor=executor,
        )
        return Prediction(
            configuration=c, topology=topology, samples=samples, cost=cost, param_shards=plan
        )
    if c.zero == 2:  # reduce-scatters need buckets padded to a multiple of dp
        buckets = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first, pad_to=dp)
    elif c.overlap:
        # DDP (and gradsync's DataParallel) rebuild their buckets from the gradient-ready order
        # of the first backward; the step that repeats is the rebuilt layout's.
        initial = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first)
        buckets = rebuild_buckets(initial, specs, ready_order(specs, model))
    else:  # the explicit sync's layout: one reused buffer (fairseq's legacy DDP)
        buckets = plan_legacy_buckets(specs, max_numel=legacy_max_numel(specs, c.bucket_cap_mb))
    shards = None
    if c.zero == 1:
        shards = plan_greedy_shards(specs, world_size=dp)
    elif c.zero == 2:
        shards = plan_flat_shards(buckets, world_size=dp)
    cost = predict_data_parallel(
        specs,
        buckets,
        machine=machine,
        model=model,
        topology=topology,
        zero=c.zero,
        shards=shards,
        overlap=c.overlap,
        param_sync=c.param_sync,
        optimizer=optimizer,
        samples=samples,
        executor=executor,
    )
    return Prediction(
        configuration=c,
        topology=topology,
        samples=samples,
        cost=cost,
        buckets=buckets,
        shards=shards,
    )
