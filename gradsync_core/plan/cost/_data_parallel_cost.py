"""The step of data parallelism with buckets (DDP) and ZeRO-1/2, walked on one rank.

The forward runs, then the backward block by block in reverse; a bucket is copied into its
buffer and its all-reduce (ZeRO-2: reduce-scatter) issued once its last gradient is ready and
the bucket before it is issued, as DDP's reducer launches buckets in order (Li et al.,
arXiv:2006.15704 §3.2.3); without overlap every bucket waits for the end of the backward and is
reduced in turn (the explicit sync). Each bucket's result is copied back once it arrives; the
sync's bookkeeping (the machine's ``step_host_s["data_parallel"]``) is waited for once. The
optimizer then steps what the rank owns; ZeRO-1/2 sync the parameters after it: each owner
broadcasts its pieces as soon as it has stepped them, the owners taking turns (torch's
``ZeroRedundancyOptimizer``), or each bucket is all-gathered (a flat ``shard_optimizer``).
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync_core.plan._buckets import MIB, Bucket, BucketPlan
from gradsync_core.plan._memory import estimate_ddp, estimate_zero1, estimate_zero2
from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._specs import ParamSpec, itemsize
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.cost._machine import (
    ALL_GATHER,
    ALL_REDUCE,
    BROADCAST,
    BUCKET_REDUCE_SCATTER,
    DATA_PARALLEL,
    REDUCE_SCATTER,
    MachineProfile,
)
from gradsync_core.plan.cost._model_profile import ModelProfile
from gradsync_core.plan.cost._timeline import (
    Channel,
    Rank,
    StepCost,
    block_numel,
    level,
    profile_at,
    rank_costs,
)

PARAM_SYNCS = ("broadcast", "all_gather")
# torch's ZeroRedundancyOptimizer broadcasts a piece at least this large alone, in place, and
# packs smaller ones (gradsync_torch/zero/broadcast.py, ALONE_BYTES).
_ALONE_BYTES = MIB


def predict_data_parallel(
    specs: Sequence[ParamSpec],
    buckets: BucketPlan,
    *,
    machine: MachineProfile,
    model: ModelProfile,
    topology: Topology,
    zero: int = 0,
    shards: ShardPlan | None = None,
    overlap: bool = True,
    param_sync: str = "broadcast",
    optimizer: str | int = "adam",
    samples: int | None = None,
    executor: str = "torch",
) -> StepCost:
    """Predict one step of data parallelism with buckets (DDP) or ZeRO-1/2.

    Args:
        specs: the parameters (one rank's shapes).
        buckets: the gradient buckets in force; for ZeRO-2 padded to a multiple of dp
            (``shards.buckets``).
        machine: the machine profile.
        model: the model profile.
        topology: the world; the ``"dp"`` group reduces.
        zero: 0 (DDP: all-reduce), 1 (all-reduce, optimizer state sharded by ``shards``) or
            2 (reduce-scatter into the flat ``shards``).
        shards: the owners of the optimizer state (ZeRO-1/2).
        overlap: reduce buckets during the backward (``False``: all after it, gradsync's
            ``overlap=False``, or a JAX step, where the update follows the gradient).
        param_sync: ZeRO's parameter sync after the local step: ``"broadcast"`` from each
            owner (torch's ``ZeroRedundancyOptimizer``) or ``"all_gather"`` per bucket (a flat
            ``shard_optimizer``).
        optimizer: the optimizer's state bytes per element (``optimizer_state_bytes``).
        samples: samples per rank and step (default: the model profile's).
        executor: whose step runs, ``"torch"`` or ``"jax"``. JAX's ``synced`` (DDP)
            all-reduces a bucket as a ``psum`` of its gradients (no copies), and without
            overlap XLA's all-reduce combiner runs the buckets' all-reduces as one. A flat
            ``shard_optimizer`` (ZeRO-2) packs a bucket of several gradients with a
            ``concatenate`` and splits it back, which costs the machine's
            ``pack_s["reduce_scatter"]`` curve (the copies and the buffers XLA:CPU allocates
            for them at every run) instead of two copies, and a bucket of one gradient is that
            gradient (no copy); without the curve, the copies as for torch. A flat
            ``shard_optimizer`` all-gathers the updates, which ``apply_updates`` then adds to
            every parameter (1.5 copies of each bucket: two reads and a write).

    Returns:
        The step's time, its collectives and per-rank memory.

    Raises:
        ValueError: a ``zero`` outside 0-2, missing or mismatched ``shards``, a parameter in
            no block of the model profile, or a group the machine profile does not cover.

    Example:
        >>> from gradsync_core.plan import LinkCost, MachineProfile, ModelProfile, BlockTime
        >>> machine = MachineProfile(name="toy", ranks_per_node=8, links=(LinkCost(
        ...     collective="all_reduce", group_size=None, latency_s=0.0, bus_bandwidth=1e9),))
        >>> specs = [ParamSpec(name="fc.weight", shape=(1000, 1000))]  # 4 MB of gradients
        >>> model = ModelProfile(samples=8, source="given", blocks=(
        ...     BlockTime(prefix="fc", forward_s=0.001, backward_s=0.002),))
        >>> cost = predict_data_parallel(specs, plan_buckets(specs), machine=machine,
        ...                              model=model, topology=Topology.create(2))
        >>> round(cost.step_s, 6), round(cost.exposed_comm_s, 6)  # 3 ms, then 4 ms exposed
        (0.007, 0.004)
    """
    if zero not in (0, 1, 2):
        raise ValueError(f"zero must be 0, 1 or 2 here (ZeRO-3: predict_zero3), got {zero!r}")
    if executor not in ("torch", "jax"):
        raise ValueError(f"executor must be 'torch' or 'jax', got {executor!r}")
    if param_sync not in PARAM_SYNCS:
        raise ValueError(f"param_sync must be one of {PARAM_SYNCS}, got {param_sync!r}")
    dp = topology.dp
    if zero and (shards is None or shards.world_size != dp):
        raise ValueError(
            f"ZeRO-{zero} needs the shard plan of its {dp} data-parallel ranks (shards=); "
            "plan it with plan_greedy_shards or plan_flat_shards"
        )
    if zero == 2 and (shards is None or shards.kind != "flat"):
        raise ValueError("ZeRO-2 reduce-scatters buckets: pass a flat shard plan")
    model, notes = profile_at(model, samples)
    dp_level = level(machine, topology, "dp")
    blocks = len(model.blocks)
    block_of = {s.name: model.block_of(s.name) for s in specs if s.requires_grad}
    # A bucket is ready once its earliest block (the last in the backward) is done.
    ready_after = [
        min(block_of[s.name] for s in b.slots) if b.slots else blocks - 1 for b in buckets.buckets
    ]
    # torch reduce-scatters ZeRO-2's buckets its own way (gradsync_torch's reduce_scatter_into);
    # XLA has one reduce-scatter
    bucket_scatter = BUCKET_REDUCE_SCATTER if executor == "torch" else REDUCE_SCATTER
    collective = bucket_scatter if zero == 2 else ALL_REDUCE
    kept = dp if zero == 2 else 1  # ZeRO-2 keeps 1/dp of each reduced bucket
    # JAX: what packing each bucket costs beyond its collective (None: copies, as torch's);
    # ``synced`` all-reduces a bucket as a psum of its gradients, which packs nothing
    packs = [
        0.0 if collective == ALL_REDUCE else _jax_pack(machine, collective, b)
        for b in buckets.buckets
    ]
    jax_packs = executor == "jax" and zero != 1 and all(p is not None for p in packs)

    rank = Rank(machine)
    channel = Channel()
    ends: list[float] = []

    def reduce(index: int) -> None:
        bucket = buckets.buckets[index]
        if jax_packs:  # the concatenate, the split and their buffers (ZeRO-2: the gather's)
            rank.compute(packs[index] or 0.0)
        else:
            rank.copy(bucket.nbytes)  # the gradients into the bucket's buffer
        what = f"bucket {bucket.index}"
        ends.append(rank.collective(channel, what, collective, "dp", dp, bucket.nbytes, dp_level))
        if not overlap:
            rank.wait(ends[-1])
            if not jax_packs:
                rank.copy(bucket.nbytes // kept)

    # The sync's bookkeeping (DDP's used-map all-reduce and its agreement check) is waited
    # for once per step: before the first bucket without overlap, after the last with it.
    bookkeeping = machine.step_host_time(DATA_PARALLEL) if dp > 1 else 0.0
    rank.compute(model.forward_s)
    issued = 0
    for index in reversed(range(blocks)):
        rank.compute(model.blocks[index].backward_s)
        while overlap and issued < len(buckets.buckets) and ready_after[issued] >= index:
            reduce(issued)
            issued += 1
    if overlap:
        for index, bucket in enumerate(buckets.buckets[:issued]):
            rank.wait(ends[index])
            if not jax_packs:
                rank.copy(bucket.nbytes // kept)  # the reduced gradients back out
    else:
        rank.compute(bookkeeping)
    if executor == "jax" and zero == 0 and not overlap and dp > 1:
        # XLA's all-reduce combiner runs the step's bucket all-reduces as one (of them all)
        for index, bucket in enumerate(buckets.buckets):
            if jax_packs:
                rank.compute(packs[index] or 0.0)
            else:
                rank.copy(bucket.nbytes)
        total = sum(b.nbytes for b in buckets.buckets)
        what = "buckets (combined)"
        rank.wait(rank.collective(channel, what, collective, "dp", dp, total, dp_level))
        if not jax_packs:
            for bucket in buckets.buckets:
                rank.copy(bucket.nbytes)
        issued = len(buckets.buckets)
    for index in range(issued, len(buckets.buckets)):
        reduce(index)
    if overlap:
        rank.wait(channel.free)
        rank.compute(bookkeeping)

    trainable = sum(s.numel for s in specs if s.requires_grad) or 1
    owned = list(shards.rank_numel) if zero and shards is not None else [trainable] * dp
    step_of = [model.optimizer_s * n / trainable for n in owned]
    slowest = max(range(dp), key=lambda r: (step_of[r], -r))
    if zero and shards is not None and param_sync == "broadcast":
        _broadcast(rank, channel, specs, shards, buckets.cap_bytes, model, slowest, dp_level)
    else:
        rank.compute(step_of[slowest])
        if zero:
            for bucket in buckets.buckets:
                what = f"bucket {bucket.index} gather"
                rank.wait(
                    rank.collective(channel, what, ALL_GATHER, "dp", dp, bucket.nbytes, dp_level)
                )
                if not jax_packs:
                    rank.copy(bucket.nbytes)
                if executor == "jax":  # apply_updates adds the gathered updates to every
                    # parameter: two reads and a write of the bucket, 1.5 copies
                    rank.compute(1.5 * machine.copy_time(bucket.nbytes))
    step = max(rank.t, channel.free)
    if zero == 0:
        memory = estimate_ddp(specs, buckets, world_size=dp, optimizer=optimizer)
    elif zero == 1:
        assert shards is not None
        memory = estimate_zero1(specs, buckets, shards, optimizer=optimizer)
    else:
        assert shards is not None
        memory = estimate_zero2(specs, shards, optimizer=optimizer)
    compute = rank.compute_s
    per_rank = [compute - step_of[slowest] + s for s in step_of]
    return StepCost(
        step_s=step,
        compute_s=compute,
        comms=rank.events(),
        ranks=rank_costs(
            memory,
            per_rank,
            step,
            model,
            block_numel(specs, model),
            [n / trainable for n in _stepped_at_once(specs, shards, buckets.cap_bytes)]
            if zero and shards is not None and param_sync == "broadcast" and dp > 1
            else [n / trainable for n in owned],
            persistent=zero < 2,  # DDP's buckets live through the step; ZeRO-2's pool lends
            # the largest bucket's all-reduce in flight; ZeRO-2's reduce-scatter writes into
            # the rank's preallocated shard (gradsync_torch's reduce_scatter_into: no scratch)
            collective_bytes=0
            if zero == 2 or dp == 1
            else max(
                (machine.scratch_bytes(ALL_REDUCE, b.nbytes) for b in buckets.buckets), default=0
            ),
        ),
        notes=tuple(notes),
    )


def _jax_pack(machine: MachineProfile, collective: str, bucket: Bucket) -> float | None:
    """What packing ``bucket`` costs the JAX executor beyond its ``collective`` (the machine's
    ``pack_s``; 0 for one gradient, which XLA passes as it is), None without a curve."""
    seconds = machine.pack_time(collective, bucket.nbytes)
    if seconds is None:
        return None
    return seconds if len(bucket.slots) > 1 else 0.0


def _broadcast(
    rank: Rank,
    channel: Channel,
    specs: Sequence[ParamSpec],
    shards: ShardPlan,
    cap_bytes: int,
    model: ModelProfile,
    me: int,
    dp_level: str,
) -> None:
    """ZeRO's parameter sync by broadcasts: every owner steps its pieces in order and sends
    each once stepped, the owners taking turns on the channel; rank ``me`` is walked, the
    others' pieces are ready after their own stepping, from the same start."""
    trainable = sum(s.numel for s in specs if s.requires_grad) or 1
    start = rank.t
    stepped = [start] * shards.world_size
    for owner, numel, nbytes in _broadcast_jobs(specs, shards, cap_bytes):
        seconds = model.optimizer_s * numel / trainable
        if owner == me:
            ready = rank.compute(seconds)
        else:
            stepped[owner] += seconds
            ready = stepped[owner]
        what = f"rank {owner} broadcast"
        dp = shards.world_size
        rank.collective(
            channel, what, BROADCAST, "dp", dp, nbytes, dp_level, ready=ready, mine=owner == me
        )


def _stepped_at_once(specs: Sequence[ParamSpec], shards: ShardPlan, cap_bytes: int) -> list[int]:
    """The most elements each rank's optimizer steps at once, which its scratch scales with:
    torch's ``ZeroRedundancyOptimizer`` steps one sync job's parameters right before their
    broadcast (gradsync_torch/zero/local_step.py): ZeRO-1 a piece of at least 1 MiB alone or
    smaller ones packed (``_broadcast_jobs``), ZeRO-2's flat shards a bucket's range at a
    time."""
    most = [0] * shards.world_size
    if shards.kind != "flat":
        for owner, numel, _ in _broadcast_jobs(specs, shards, cap_bytes):
            most[owner] = max(most[owner], numel)
        return most
    bucket_of = {
        slot.name: bucket.index
        for bucket in (shards.buckets.buckets if shards.buckets is not None else ())
        for slot in bucket.slots
    }
    per_bucket: dict[tuple[int, int], int] = {}
    for shard in shards.shards:
        key = (shard.rank, bucket_of[shard.name])
        per_bucket[key] = per_bucket.get(key, 0) + shard.numel
    for (rank, _), numel in per_bucket.items():
        most[rank] = max(most[rank], numel)
    return most


def _broadcast_jobs(
    specs: Sequence[ParamSpec], shards: ShardPlan, cap_bytes: int
) -> list[tuple[int, int, int]]:
    """``(owner, elements, bytes)`` of each broadcast of a ZeRO parameter sync, in the order
    they run: a piece of at least 1 MiB alone, smaller ones packed up to the bucket cap, the
    owners taking turns (gradsync_torch/zero/broadcast.py)."""
    size = {s.name: itemsize(s.dtype) for s in specs}
    per_owner: list[list[tuple[int, int]]] = [[] for _ in range(shards.world_size)]
    packed = [(0, 0)] * shards.world_size
    for shard in shards.shards:
        nbytes = shard.numel * size[shard.name]
        if nbytes >= _ALONE_BYTES:
            per_owner[shard.rank].append((shard.numel, nbytes))
            continue
        numel, total = packed[shard.rank]
        if total and total + nbytes > cap_bytes:
            per_owner[shard.rank].append((numel, total))
            numel, total = 0, 0
        packed[shard.rank] = (numel + shard.numel, total + nbytes)
    for owner, (numel, total) in enumerate(packed):
        if total:
            per_owner[owner].append((numel, total))
    jobs = []
    for turn in range(max((len(j) for j in per_owner), default=0)):
        for owner, owned in enumerate(per_owner):
            if turn < len(owned):
                jobs.append((owner, *owned[turn]))
    return jobs
