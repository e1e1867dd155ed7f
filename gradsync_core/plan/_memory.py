"""Per-rank memory of model states under DDP and ZeRO-1/2/3, predicted from the plans.

DeepSpeed's estimator style; formulas in docs/design.md §16.

Model states only: parameters, gradients, optimizer state and the communication buffers or
gathered units that live next to them. Activations depend on the batch and are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._buckets import BucketPlan
from gradsync_core.plan._canonical import PLAN_VERSION
from gradsync_core.plan._param_shards import ParamShardPlan, Unit
from gradsync_core.plan._param_units import ROOT
from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._specs import ParamSpec, itemsize

# Optimizer state per trainable element, in bytes, with fp32 state (torch keeps state in the
# parameter's dtype, so fp32 parameters or fp32 master copies). Adam/AdamW: exp_avg and
# exp_avg_sq; the per-parameter ``step`` scalar is a few bytes per tensor and left out.
OPTIMIZER_STATE_BYTES: Mapping[str, int] = {
    "adam": 8,
    "adamw": 8,
    "lion": 4,
    "adagrad": 4,
    "rmsprop": 4,
    "sgd-momentum": 4,
    "sgd": 0,
}


def optimizer_state_bytes(optimizer: str | int) -> int:
    """Bytes of state per trainable element for a named optimizer, or the int given.

    Raises:
        ValueError: an unknown name or a negative count.

    Example:
        >>> optimizer_state_bytes("adamw"), optimizer_state_bytes(12)
        (8, 12)
    """
    if isinstance(optimizer, int) and not isinstance(optimizer, bool):
        if optimizer < 0:
            raise ValueError(f"optimizer state bytes per element must be >= 0, got {optimizer}")
        return optimizer
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZER_STATE_BYTES:
        known = ", ".join(OPTIMIZER_STATE_BYTES)
        raise ValueError(
            f"unknown optimizer {optimizer!r}; use one of {known} or give the state bytes "
            "per element as an int"
        )
    return OPTIMIZER_STATE_BYTES[optimizer]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankMemory:
    """Predicted bytes on one rank (a data-parallel rank; a shard rank under HSDP)."""

    rank: int
    parameter_bytes: int  # resident parameters: whole (ZeRO-0/1/2) or this rank's padded chunks
    gradient_bytes: int  # resident gradients after backward, padding included
    optimizer_state_bytes: int
    transient_bytes: int  # buckets in flight, or gathered units (ZeRO-3), at the worst moment

    @property
    def peak_bytes(self) -> int:
        """The model-state peak: the resident terms plus the worst moment's transient bytes."""
        return (
            self.parameter_bytes
            + self.gradient_bytes
            + self.optimizer_state_bytes
            + self.transient_bytes
        )

    def to_json(self) -> dict[str, int]:
        return {
            "rank": self.rank,
            "parameter_bytes": self.parameter_bytes,
            "gradient_bytes": self.gradient_bytes,
            "optimizer_state_bytes": self.optimizer_state_bytes,
            "transient_bytes": self.transient_bytes,
            "peak_bytes": self.peak_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    """Per-rank model-state memory of one ZeRO stage (0 is DDP: everything replicated)."""

    zero: int
    world_size: int
    replicate_size: int  # ZeRO-3 with HSDP: ranks repeat their shard rank's figures
    state_bytes_per_element: int
    ranks: tuple[RankMemory, ...]  # one per data-parallel rank (per shard rank under HSDP)

    @property
    def max(self) -> RankMemory:
        """The fullest rank, by peak (the lowest rank on ties)."""
        return max(self.ranks, key=lambda r: (r.peak_bytes, -r.rank))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "memory_estimate",
            "version": PLAN_VERSION,
            "zero": self.zero,
            "world_size": self.world_size,
            "replicate_size": self.replicate_size,
            "optimizer_state_bytes_per_element": self.state_bytes_per_element,
            "ranks": [r.to_json() for r in self.ranks],
            "max_rank": self.max.to_json(),
        }


def _replicated(specs: Sequence[ParamSpec]) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) of a whole replica."""
    return sum(s.nbytes for s in specs), sum(s.nbytes for s in specs if s.requires_grad)


def _estimate(
    zero: int,
    *,
    params: int,
    grads: int,
    state_numel: Sequence[int],
    transient: int,
    per_element: int,
    world_size: int,
    replicate_size: int = 1,
) -> MemoryEstimate:
    """One ``RankMemory`` per entry of ``state_numel`` (the state elements each rank owns)."""
    ranks = tuple(
        RankMemory(
            rank=r,
            parameter_bytes=params,
            gradient_bytes=grads,
            optimizer_state_bytes=numel * per_element,
            transient_bytes=transient,
        )
        for r, numel in enumerate(state_numel)
    )
    return MemoryEstimate(
        zero=zero,
        world_size=world_size,
        replicate_size=replicate_size,
        state_bytes_per_element=per_element,
        ranks=ranks,
    )


def estimate_ddp(
    specs: Sequence[ParamSpec],
    buckets: BucketPlan,
    *,
    world_size: int,
    optimizer: str | int = "adam",
) -> MemoryEstimate:
    """ZeRO-0 (DDP): parameters P, gradients G, state S on every rank, plus DDP's bucket
    buffers B (one per bucket, alive for the whole run): ``P + G + S + B``."""
    params, grads = _replicated(specs)
    return _estimate(
        0,
        params=params,
        grads=grads,
        state_numel=[sum(s.numel for s in specs if s.requires_grad)] * world_size,
        transient=buckets.nbytes,
        per_element=optimizer_state_bytes(optimizer),
        world_size=world_size,
    )


def estimate_zero1(
    specs: Sequence[ParamSpec],
    buckets: BucketPlan,
    shards: ShardPlan,
    *,
    optimizer: str | int = "adam",
) -> MemoryEstimate:
    """ZeRO-1: as DDP but the state of the elements the shard plan gives each rank only:
    ``P + G + B + owned_r * s`` (greedy plans are uneven, so ranks differ)."""
    params, grads = _replicated(specs)
    return _estimate(
        1,
        params=params,
        grads=grads,
        state_numel=shards.rank_numel,
        transient=buckets.nbytes,
        per_element=optimizer_state_bytes(optimizer),
        world_size=shards.world_size,
    )


def estimate_zero2(
    specs: Sequence[ParamSpec], shards: ShardPlan, *, optimizer: str | int = "adam"
) -> MemoryEstimate:
    """ZeRO-2: each rank keeps its 1/N chunk of every (padded) bucket of gradients, the state
    of those elements, and while reducing one pooled bucket buffer plus the next bucket's
    gradients: ``P + sum_b numel_b/N * itemsize_b + owned_r * s + 2 * max_b bytes_b``.

    Raises:
        ValueError: if ``shards`` is not a flat plan (gradients are cut by element ranges).
    """
    if shards.kind != "flat" or shards.buckets is None:
        raise ValueError("ZeRO-2 shards gradients as flat element ranges; pass a flat ShardPlan")
    n = shards.world_size
    buckets = shards.buckets.buckets
    return _estimate(
        2,
        params=_replicated(specs)[0],
        grads=sum(b.numel // n * itemsize(b.dtype) for b in buckets),
        state_numel=shards.rank_numel,
        transient=2 * max((b.nbytes for b in buckets), default=0),
        per_element=optimizer_state_bytes(optimizer),
        world_size=n,
    )


def estimate_zero3(
    plan: ParamShardPlan,
    *,
    optimizer: str | int = "adam",
    prefetch: int = 1,
    reshard_after_forward: bool = True,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    tied: Iterable[str] = (),
) -> MemoryEstimate:
    """ZeRO-3 (FSDP2): each rank stores its padded chunk of every parameter and of every
    trainable gradient, and the state of its unpadded rows. On top (``transient``): the
    gathered root (FSDP2 keeps the root unsharded from forward to backward), the
    ``1 + prefetch`` largest gathered blocks (all of them with ``reshard_after_forward=False``),
    and the worst unit's backward: its unsharded gradients plus the larger of the
    reduce-scatter input and, for ``tied`` parameters (used twice, so autograd accumulates
    them), two more copies of their gradients, less the unit's own sharded gradients, which
    do not exist yet. ``param_dtype``/``reduce_dtype`` are the mixed-precision policy's
    (default: the stored dtype); they change the gathered sizes, never the plan.

    Raises:
        ValueError: a bad ``prefetch`` or a ``tied`` name that is not in the plan.
    """
    per_element = optimizer_state_bytes(optimizer)
    if not isinstance(prefetch, int) or prefetch < 0:
        raise ValueError(f"prefetch must be a non-negative int, got {prefetch!r}")
    tied = check_tied(plan, tied)
    sizes = [
        zero3_unit_bytes(plan, u, param_dtype=param_dtype, reduce_dtype=reduce_dtype, tied=tied)
        for u in plan.units
    ]
    root = sum(b.gathered for u, b in zip(plan.units, sizes, strict=True) if u.prefix == ROOT)
    blocks = sorted(b.gathered for u, b in zip(plan.units, sizes, strict=True) if u.prefix != ROOT)
    window = blocks if not reshard_after_forward else blocks[max(0, len(blocks) - 1 - prefetch) :]
    backward = max(max(0, b.gradients + max(b.reduce_input, b.accumulate) - b.shard) for b in sizes)
    transient = root + sum(window) + backward
    return _estimate(
        3,
        params=sum(plan.unit_padded_nbytes(u.index) for u in plan.units),
        grads=sum(plan.unit_padded_nbytes(u.index, trainable_only=True) for u in plan.units),
        state_numel=_trainable_rows_numel(plan),
        transient=transient,
        per_element=per_element,
        world_size=plan.world_size,
        replicate_size=plan.replicate_size,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class UnitBytes:
    """One ZeRO-3 unit's buffers on a shard rank, in bytes (padding included), as
    ``fully_shard`` makes them: ``estimate_zero3`` and the cost model's walk of the step
    (``gradsync_core.plan.cost``) both read them."""

    gathered: int  # every parameter all-gathered, in the gather dtype
    send: int  # the all-gather's input: this rank's chunks, in the gather dtype
    gradients: int  # the unsharded gradients autograd makes, in the gather dtype
    reduce_input: int  # the reduce-scatter's input: every rank's chunk of every gradient
    accumulate: int  # tied parameters' gradients, accumulated by autograd: two more copies
    shard: int  # this rank's reduce-scattered gradient chunk, in the stored dtype


def check_tied(plan: ParamShardPlan, tied: Iterable[str]) -> set[str]:
    """``tied`` as a set of the plan's parameter names.

    Raises:
        ValueError: a name that is not in the plan.
    """
    tied = set(tied)
    unknown = sorted(tied - {p.name for p in plan.params})
    if unknown:
        raise ValueError(f"tied parameter {unknown[0]!r} is not in the plan; name it as listed")
    return tied


def gathered_bytes(plan: ParamShardPlan, names: Iterable[str], dtype: str | None = None) -> int:
    """Bytes of the named parameters all-gathered over the shard group, padding included, in
    ``dtype`` (default: each one's stored dtype)."""
    return plan.shard_size * sum(
        plan.chunk(name, 0).padded_numel * itemsize(dtype or plan.param(name).dtype)
        for name in names
    )


def zero3_unit_bytes(
    plan: ParamShardPlan,
    unit: Unit,
    *,
    param_dtype: str | None = None,
    reduce_dtype: str | None = None,
    tied: Iterable[str] = (),
) -> UnitBytes:
    """The buffers of ``unit`` (``UnitBytes``) under a mixed-precision policy's
    ``param_dtype``/``reduce_dtype`` (default: the stored dtypes); ``tied``: parameters used
    twice."""
    tied = set(tied)
    trainable = [name for name in unit.params if plan.param(name).requires_grad]
    twice = [name for name in trainable if name in tied]
    gathered = gathered_bytes(plan, unit.params, param_dtype)
    return UnitBytes(
        gathered=gathered,
        send=gathered // plan.shard_size,
        gradients=gathered_bytes(plan, trainable, param_dtype),
        reduce_input=gathered_bytes(plan, trainable, reduce_dtype or param_dtype),
        accumulate=2 * gathered_bytes(plan, twice, param_dtype),
        shard=plan.unit_padded_nbytes(unit.index, trainable_only=True),
    )


def _trainable_rows_numel(plan: ParamShardPlan) -> list[int]:
    """Unpadded trainable elements per shard rank, in O(parameters + ranks).

    Under ``torch.chunk`` a parameter of ``d`` rows and chunk ``c`` gives ``c`` rows to ranks
    ``[0, d // c)``, ``d % c`` rows to rank ``d // c`` and none to the rest: two steps of a
    difference array instead of a loop over every rank.
    """
    n = plan.shard_size
    diff = [0] * (n + 1)
    for p in plan.params:
        if not p.requires_grad or p.shape[0] == 0:
            continue
        chunk = plan.chunk(p.name, 0)
        full, rest = divmod(p.shape[0], chunk.padded_rows)
        diff[0] += chunk.padded_numel
        diff[full] -= chunk.padded_numel
        if rest:
            diff[full] += rest * chunk.row_numel
            diff[full + 1] -= rest * chunk.row_numel
    out, running = [], 0
    for r in range(n):
        running += diff[r]
        out.append(running)
    return out
