"""The step timeline of a pipeline: the simulator's ticks with the profiled stage times.

The pipeline's own timeline is ``simulate_pipeline``'s (the validator's walk, with durations):
each stage's forward and backward time is the sum of its blocks' in the model profile, the
weight-gradient half of a split backward half of it, and a point-to-point message the time of
the largest activation crossing a stage boundary. On top of it each pipeline rank reduces its
stages' gradients over the data-parallel group once its last action is done (gradsync's
``Pipeline`` syncs a stage's buckets at ``REDUCE_GRAD``) and steps the optimizer on its own
parameters (without data parallelism nothing is reduced and no bucket is allocated); the
executors' host work (the machine's ``host_s`` and ``step_host_s``) is on the rank's clock
there, and delays each message; the runtime's posting of each send and receive (``post_s``)
is the simulator's ``post`` and ``receive_post``, on the posting rank's clock. Where the
machine has fewer ``cores`` than the job's ranks (CPU ranks on one node), the simulator shares
them among the ranks runnable at each moment, the plan's dp replicas with them, its stage times
read as measured with every rank computing. The data-parallel sync is ``DataParallel(overlap=
False)``'s: the legacy layout's buckets, each copied in, all-reduced and copied out. Memory per
pipeline rank is its stages' model states (``estimate_ddp``) plus the activations its
stashed microbatches hold, followed through the simulated order.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import replace

from gradsync_core.plan._buckets import legacy_max_numel, plan_legacy_buckets
from gradsync_core.plan._memory import estimate_ddp
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan.cost._machine import (
    ALL_REDUCE,
    DATA_PARALLEL,
    P2P,
    RECEIVE,
    SEND,
    MachineProfile,
)
from gradsync_core.plan.cost._model_profile import ModelProfile, contains
from gradsync_core.plan.cost._timeline import (
    Channel,
    CommEvent,
    RankCost,
    StepCost,
    block_numel,
    profile_at,
    uncovered,
)
from gradsync_core.plan.pipeline._actions import (
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    SEND_B,
    SEND_F,
)
from gradsync_core.plan.pipeline._plan import PipelinePlan
from gradsync_core.plan.pipeline._sim import PipelineSimulation, TimedAction, simulate_pipeline

WEIGHT_SHARE = 0.5  # a split backward's weight half, as the plan's chart draws it


def stage_of_blocks(plan: PipelinePlan, model: ModelProfile) -> list[int]:
    """The stage that computes each block of the profile.

    Raises:
        ValueError: a block no stage names, or one that two stages share.
    """
    out = []
    for block in model.blocks:
        found = {
            stage.index
            for stage in plan.stages
            for module in stage.modules
            if contains(module, block.prefix) or contains(block.prefix, module)
        }
        if len(found) != 1:
            where = "no stage" if not found else f"stages {sorted(found)}"
            raise ValueError(
                f"block {block.prefix!r} of the model profile is computed by {where} of the "
                "pipeline plan; plan the pipeline from the model's specs (plan_pipeline(specs=)) "
                "and profile the modules its stages name"
            )
        out.append(found.pop())
    return out


def predict_pipeline(
    plan: PipelinePlan,
    specs: Sequence[ParamSpec],
    *,
    machine: MachineProfile,
    model: ModelProfile,
    optimizer: str | int = "adam",
    samples: int | None = None,
    bucket_cap_mb: float | None = None,
) -> StepCost:
    """Predict one step of the pipeline ``plan`` (every pipeline group runs it alike).

    Args:
        plan: the pipeline plan, planned from ``specs`` so its stages name modules.
        specs: the model's parameters.
        machine: the machine profile.
        model: the model profile.
        optimizer: the optimizer's state bytes per element.
        samples: samples per microbatch (default: the model profile's).
        bucket_cap_mb: the data-parallel buckets of each rank's parameters.

    Returns:
        The step's time (the simulator's, plus the reductions and the optimizer), every
        point-to-point message and reduction, and each pipeline rank's memory.

    Raises:
        ValueError: a ZeRO-3 plan (not modeled here), a block no stage computes, or a group
            the machine profile lacks.
    """
    if plan.zero3:
        raise ValueError(
            "the cost of pipeline stages under ZeRO-3 (zero3=True) is not modeled; predict the "
            "plan without zero3"
        )
    model, notes = profile_at(model, samples)
    topo = plan.topology
    stages = stage_of_blocks(plan, model)
    n = plan.num_stages
    activations = [0] * n
    for block, stage in zip(model.blocks, stages, strict=True):
        activations[stage] += block.activation_bytes or 0
    sim, message, p2p = _simulate(plan, specs, machine, model, stages, notes)

    block_of = {s.name: model.block_of(s.name) for s in specs}
    rank_specs: list[list[ParamSpec]] = [[] for _ in range(plan.pp)]
    for spec in specs:
        rank_specs[plan.stage_ranks[stages[block_of[spec.name]]]].append(spec)
    trainable = sum(s.numel for s in specs if s.requires_grad) or 1
    dp = topo.dp
    dp_level = machine.level_of(topo.group_at("dp", 0))
    comms: list[CommEvent] = []
    ranks = []
    busy = [
        [(t.start, t.end) for t in timed if t.end > t.start] for timed in sim.actions[: plan.pp]
    ]
    ends = []
    for r in range(plan.pp):
        # Without data parallelism nothing reduces: no stage is wrapped, no bucket exists.
        # DataParallel(overlap=False) per stage: the explicit sync's layout, one reused buffer
        # (plan_legacy_buckets, as predict costs DDP without overlap).
        mine = rank_specs[r] if dp > 1 else []
        buckets = plan_legacy_buckets(mine, max_numel=legacy_max_numel(mine, bucket_cap_mb))
        channel = Channel()
        last = max((t.end for t in sim.actions[r]), default=0.0)
        # The sync's bookkeeping, then each bucket copied into the buffer, issued (its host
        # work on the rank), waited for and copied back out, in turn.
        host = machine.step_host_time(DATA_PARALLEL) if dp > 1 else 0.0
        clock = last + host
        for bucket in buckets.buckets:
            copy = machine.copy_time(bucket.nbytes)
            issue = machine.issue_time(ALL_REDUCE, bucket.nbytes, dp, dp_level)
            host += issue + 2 * copy
            start, end = channel.run(
                clock + copy + issue, machine.time(ALL_REDUCE, bucket.nbytes, dp, dp_level)
            )
            clock = end + copy
            comms.append(
                CommEvent(
                    what=f"pp rank {r} bucket {bucket.index}",
                    collective=ALL_REDUCE,
                    group="dp",
                    group_size=dp,
                    nbytes=bucket.nbytes,
                    start_s=start,
                    end_s=end,
                    exposed_s=end - start,
                )
            )
        owned = sum(s.numel for s in rank_specs[r] if s.requires_grad)
        step_r = model.optimizer_s * owned / trainable
        ends.append(max(clock, channel.free) + step_r)
        memory = estimate_ddp(rank_specs[r], buckets, world_size=dp, optimizer=optimizer).ranks[0]
        compute = sim.busy[r] + sim.host[r] + host + step_r  # sim.host: the message posts
        ranks.append((r, compute, replace(memory, rank=r), owned / trainable))
    step = max(ends)
    for timed in sim.actions[: plan.pp]:  # one replica's ranks (the simulation's first)
        for t in timed:
            if t.action.kind in (SEND_F, SEND_B):
                s = t.action.stage
                to = s + 1 if t.action.kind == SEND_F else s - 1
                edge = s if t.action.kind == SEND_F else to
                receiver = plan.stage_ranks[to]
                comms.append(
                    CommEvent(
                        what=str(t.action),
                        collective=P2P,
                        group="pp",
                        group_size=2,
                        nbytes=message[edge],
                        start_s=t.start,
                        end_s=t.start + p2p,
                        exposed_s=uncovered(t.start, t.start + p2p, busy[receiver]),
                    )
                )
    activation_known = model.activation_bytes is not None
    scratch = model.optimizer_bytes
    costs = tuple(
        RankCost(
            rank=r,
            compute_s=compute,
            idle_s=step - compute,
            memory=memory,
            activation_bytes=_stash_peak(sim.actions[r], activations) if activation_known else None,
            optimizer_peak_bytes=None
            if scratch is None
            else memory.peak_bytes + round(scratch * share),
        )
        for r, compute, memory, share in ranks
    )
    critical = max(costs, key=lambda c: (ends[c.rank], -c.rank))
    return StepCost(
        step_s=step,
        compute_s=critical.compute_s,
        comms=tuple(sorted(comms, key=lambda c: (c.start_s, c.what))),
        ranks=costs,
        notes=tuple(notes),
    )


def pipeline_simulation(
    plan: PipelinePlan,
    specs: Sequence[ParamSpec],
    *,
    machine: MachineProfile,
    model: ModelProfile,
    samples: int | None = None,
) -> PipelineSimulation:
    """The simulated timeline ``predict_pipeline`` costs ``plan`` on (before the reductions
    and the optimizer): what a probe lays beside the executor's recorded timeline.

    Raises:
        ValueError: as ``predict_pipeline``.
    """
    model, notes = profile_at(model, samples)
    return _simulate(plan, specs, machine, model, stage_of_blocks(plan, model), notes)[0]


def phase_starts(model: ModelProfile, numel: Sequence[int]) -> tuple[float, float]:
    """What the profiled step spends starting its forward and its backward, beyond the blocks'
    work: ``(forward start, backward start)``.

    The profile times one step of the whole model, after the previous step's optimizer: its
    first block's forward holds the step's start (the caches the optimizer left cold), its
    last block's backward the backward's start after the forward. Each is that block's time
    beyond its share at the other blocks' median time per trainable element (``numel``, per
    block), and 0 where that share is larger (a first block that costs less per element, an
    embedding) or there is no other block to compare with. A pipeline rank pays the forward
    start at its first forward of the step and the backward start at each backward right
    after a forward (measured on the executor: docs/cost-model.md, "Pipelines").
    """

    def beyond(times: list[float], k: int) -> float:
        rates = [t / e for i, (t, e) in enumerate(zip(times, numel, strict=True)) if i != k and e]
        if not rates or not numel[k]:
            return 0.0
        return max(0.0, times[k] - statistics.median(rates) * numel[k])

    last = len(model.blocks) - 1
    return (
        beyond([b.forward_s for b in model.blocks], 0),
        beyond([b.backward_s for b in model.blocks], last),
    )


def _simulate(
    plan: PipelinePlan,
    specs: Sequence[ParamSpec],
    machine: MachineProfile,
    model: ModelProfile,
    stages: Sequence[int],
    notes: list[str],
) -> tuple[PipelineSimulation, list[int], float]:
    """The simulation of ``plan`` with the profiled stage times, each boundary's message
    bytes and the message time the simulation took (a note added where boundaries differ).

    A stage's forward and backward are its blocks' in the profile, less the profiled step's
    phase starts (``phase_starts``), which the simulation charges where the executor pays
    them: each rank's first forward, and a backward right after a forward.
    """
    n = plan.num_stages
    forward, backward = [0.0] * n, [0.0] * n
    for block, stage in zip(model.blocks, stages, strict=True):
        forward[stage] += block.forward_s
        backward[stage] += block.backward_s
    first_forward, backward_start = phase_starts(model, block_numel(specs, model))
    forward[stages[0]] -= first_forward
    backward[stages[-1]] -= backward_start
    last_block = {stage: index for index, stage in enumerate(stages)}
    message = [model.blocks[last_block[s]].output_bytes if s in last_block else 0 for s in range(n)]
    pp_ranks = plan.topology.group_at("pp", 0)

    def p2p_time(s: int) -> float:
        """A message's wire time plus its issue and host work (``host_s["p2p"]``), which
        delay its data at the receiver; the runtime's posts (``post_s``) are the simulator's
        ``post`` and ``receive_post``, on the posting rank."""
        pair = (pp_ranks[plan.stage_ranks[s]], pp_ranks[plan.stage_ranks[s + 1]])
        at = machine.level_of(pair)
        return machine.time(P2P, message[s], 2, at) + machine.issue_time(P2P, message[s], 2, at)

    crossings = [s for s in range(n - 1) if plan.stage_ranks[s] != plan.stage_ranks[s + 1]]
    p2p = max((p2p_time(s) for s in crossings), default=0.0)
    if len({message[s] for s in crossings}) > 1:
        notes.append("point-to-point: every message takes the largest boundary's time")
    cores, replicas = None, 1  # a core per rank: the closed forms
    world = plan.pp * plan.topology.dp
    if machine.cores is not None and world <= machine.ranks_per_node and world > machine.cores:
        # The profile's times are each rank's with every rank of the node computing (as a
        # data-parallel step runs): each at cores / world of its speed. The simulator takes
        # the time on a core of its own and shares the cores among the ranks runnable at
        # each moment, the plan's dp replicas with them.
        cpu = machine.cores / world
        forward, backward = [f * cpu for f in forward], [b * cpu for b in backward]
        first_forward, backward_start = first_forward * cpu, backward_start * cpu
        cores, replicas = float(machine.cores), plan.topology.dp
        notes.append(
            f"pipeline: {world} ranks share {machine.cores} cores (the profile's times read as "
            "measured with every rank computing)"
        )
    sim = simulate_pipeline(
        plan,
        forward=forward,
        backward=backward,
        weight=[b * WEIGHT_SHARE for b in backward],
        p2p=p2p,
        post=machine.post_time(SEND),
        receive_post=machine.post_time(RECEIVE),
        first_forward=first_forward,
        backward_after_forward=backward_start,
        cores=cores,
        dp=replicas,
    )
    return sim, message, p2p


def _stash_peak(timed: Sequence[TimedAction], activations: Sequence[int]) -> int:
    """The most activation bytes a rank holds at once: a forward adds its stage's, the full
    or weight backward of that microbatch frees them."""
    live = peak = 0
    for t in timed:
        action = t.action
        if action.kind == FORWARD:
            live += activations[action.stage]
            peak = max(peak, live)
        elif action.kind in (FULL_BACKWARD, BACKWARD_WEIGHT):
            live -= activations[action.stage]
    return peak
