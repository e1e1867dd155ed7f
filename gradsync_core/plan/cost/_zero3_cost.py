"""The step of ZeRO-3 (FSDP2's ``fully_shard``, and HSDP), walked on one shard rank.

FSDP2's order (Zhao et al., arXiv:2304.11277; torch's ``fully_shard``): the root unit is
all-gathered first and kept to the end of the backward; each block's unit is all-gathered
before its first block runs, ``prefetch`` units ahead while an earlier one computes, copied out
of the gather buffer, and freed after its forward when ``reshard_after_forward`` (then gathered
again, with the same prefetch, before its backward). When a unit's backward is done its
gradients are copied into the reduce-scatter's input and reduce-scattered over the shard group
and, under HSDP, the shard all-reduced over the replicas on their own channel; the root reduces
once the whole backward is done. Without overlap (one XLA program on the CPU) every collective
is waited for where it is issued. Once every gradient is reduced the step's bookkeeping (the
machine's ``step_host_s["zero3"]``: the agreement checks) runs, then the optimizer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from gradsync_core.plan._memory import _trainable_rows_numel, estimate_zero3
from gradsync_core.plan._param_shards import ParamShardPlan
from gradsync_core.plan._param_units import ROOT
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.cost._machine import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    ZERO3,
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


def predict_zero3(
    plan: ParamShardPlan,
    *,
    machine: MachineProfile,
    model: ModelProfile,
    topology: Topology,
    reshard_after_forward: bool = True,
    prefetch: int = 1,
    overlap: bool = True,
    optimizer: str | int = "adam",
    samples: int | None = None,
    tied: Sequence[str] = (),
) -> StepCost:
    """Predict one step of ZeRO-3 (FSDP2's ``fully_shard``; HSDP with ``topology.dp_shard``).

    Args:
        plan: the parameter-shard plan (its units and chunks); its shard size is the
            topology's ``dp_shard``.
        machine: the machine profile.
        model: the model profile; each block's parameters must lie in one unit.
        topology: the world: all-gathers and reduce-scatters run over ``"dp_shard"``, the
            HSDP all-reduce over ``"dp_replicate"``.
        reshard_after_forward: free a unit after its forward and gather it again for the
            backward (``False``: keep it, one all-gather less per unit).
        prefetch: units gathered ahead of the one computing.
        overlap: collectives run beside compute (``False``: each is waited for where it is
            issued, as in one XLA program on the CPU).
        optimizer: the optimizer's state bytes per element.
        samples: samples per rank and step (default: the model profile's).
        tied: parameters used twice (``estimate_zero3``'s ``tied``).

    Returns:
        The step's time, its collectives and per-shard-rank memory.

    Raises:
        ValueError: a plan that does not match the topology, a block whose parameters lie in
            two units, a parameter in no block, or a group the machine profile lacks.
    """
    if (plan.shard_size, plan.replicate_size) != (topology.dp_shard, topology.dp_replicate):
        raise ValueError(
            f"the plan shards over {plan.shard_size} ranks x {plan.replicate_size} replicas but "
            f"the topology has dp_shard {topology.dp_shard} x dp_replicate "
            f"{topology.dp_replicate}; plan with world_size=topology.dp, dp_shard=topology.dp_shard"
        )
    if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 0:
        raise ValueError(f"prefetch must be an int >= 0, got {prefetch!r}")
    model, notes = profile_at(model, samples)
    walk = _Walk(plan, machine, topology, overlap=overlap, prefetch=prefetch)
    walk.run(model, _units_of_blocks(plan, model), reshard_after_forward)
    memory = estimate_zero3(
        plan,
        optimizer=optimizer,
        prefetch=prefetch,
        reshard_after_forward=reshard_after_forward,
        tied=tied,
    )
    shares = _trainable_rows_numel(plan)
    total = sum(shares) or 1
    step_of = [model.optimizer_s * k / total for k in shares]
    slowest = max(range(plan.shard_size), key=lambda r: (step_of[r], -r))
    rank = walk.rank
    rank.wait(walk.synced)
    if plan.shard_size * plan.replicate_size > 1:  # the step's checks, once the gradients are in
        rank.compute(machine.step_host_time(ZERO3))
    rank.compute(step_of[slowest])
    compute = rank.compute_s
    specs = [
        ParamSpec(name=p.name, shape=p.shape, dtype=p.dtype, requires_grad=p.requires_grad)
        for p in plan.params
    ]
    return StepCost(
        step_s=rank.t,
        compute_s=compute,
        comms=rank.events(),
        ranks=rank_costs(
            memory,
            [compute - step_of[slowest] + s for s in step_of],
            rank.t,
            model,
            block_numel(specs, model),
            [k / total for k in shares],
            persistent=False,
            collective_bytes=walk.scratch_bytes(machine),
        ),
        notes=tuple(notes),
    )


def _units_of_blocks(plan: ParamShardPlan, model: ModelProfile) -> list[int]:
    """The unit each block of the profile computes with (the root for a block without
    parameters).

    Raises:
        ValueError: a block holds parameters of two units.
    """
    units: list[set[int]] = [set() for _ in model.blocks]
    for p in plan.params:
        units[model.block_of(p.name)].add(p.unit)
    root = next(u.index for u in plan.units if u.prefix == ROOT)
    out = []
    for block, found in zip(model.blocks, units, strict=True):
        if len(found) > 1:
            prefixes = sorted(plan.units[u].prefix for u in found)
            raise ValueError(
                f"block {block.prefix!r} of the model profile holds parameters of the units "
                f"{prefixes}; profile each unit's modules as blocks of their own"
            )
        out.append(found.pop() if found else root)
    return out


class _Walk:
    """One ZeRO-3 step: gathers and reduce-scatters on the shard group's channel, HSDP's
    all-reduces on the replicate group's, compute on the rank."""

    def __init__(
        self,
        plan: ParamShardPlan,
        machine: MachineProfile,
        topology: Topology,
        *,
        overlap: bool,
        prefetch: int,
    ) -> None:
        self.n, self.replicas = plan.shard_size, plan.replicate_size
        self.overlap = overlap
        self.prefetch = prefetch if overlap else 0
        self.shard_level = level(machine, topology, "dp_shard")
        self.replicate_level = level(machine, topology, "dp_replicate")
        self.gathered = [plan.unit_padded_nbytes(u.index) * self.n for u in plan.units]
        self.grads = [plan.unit_padded_nbytes(u.index, trainable_only=True) for u in plan.units]
        self.roots = {u.index for u in plan.units if u.prefix == ROOT}
        self.shard, self.replicate = Channel(), Channel()
        self.rank = Rank(machine)

    def gather(self, unit: int, phase: str) -> float:
        what = f"unit {unit} all-gather ({phase})"
        return self.rank.collective(
            self.shard, what, ALL_GATHER, "dp_shard", self.n, self.gathered[unit], self.shard_level
        )

    def use(self, unit: int, ready: float) -> None:
        """Wait for a unit's gather, then copy it out of the gather buffer."""
        self.rank.wait(ready)
        self.rank.copy(self.gathered[unit])

    def reduce(self, unit: int) -> None:
        rank = self.rank
        rank.copy(self.grads[unit] * self.n)  # the gradients into the reduce-scatter's input
        end = rank.collective(
            self.shard,
            f"unit {unit} reduce-scatter",
            REDUCE_SCATTER,
            "dp_shard",
            self.n,
            self.grads[unit] * self.n,
            self.shard_level,
        )
        if self.replicas > 1:
            end = rank.collective(
                self.replicate,
                f"unit {unit} all-reduce",
                ALL_REDUCE,
                "dp_replicate",
                self.replicas,
                self.grads[unit],
                self.replicate_level,
                ready=end,
            )
        if not self.overlap:
            rank.wait(end)

    def run(self, model: ModelProfile, unit_of_block: Sequence[int], reshard: bool) -> None:
        """Forward then backward, in FSDP2's gather, prefetch and reduce order."""
        order = list(dict.fromkeys(u for u in unit_of_block if u not in self.roots))
        for unit in sorted(self.roots):  # a root without parameters gathers nothing
            if self.gathered[unit]:
                self.use(unit, self.gather(unit, "forward"))
        self._phase(model, unit_of_block, order, {}, "forward", range(len(model.blocks)))
        backward = list(reversed(order))
        again: dict[int, float] = {} if reshard else {u: -1.0 for u in order}
        first = {u: unit_of_block.index(u) for u in order}
        blocks = reversed(range(len(model.blocks)))
        self._phase(model, unit_of_block, backward, again, "backward", blocks, first)
        for unit in sorted(self.roots):  # the root reduces once the whole backward is done
            if self.grads[unit]:
                self.reduce(unit)

    def _phase(
        self,
        model: ModelProfile,
        unit_of_block: Sequence[int],
        order: list[int],
        ready: dict[int, float],
        phase: str,
        blocks: Iterable[int],
        reduce_after: dict[int, int] | None = None,
    ) -> None:
        issued = 0
        used: set[int] = set()
        for index in blocks:
            unit = unit_of_block[index]
            block = model.blocks[index]
            seconds = block.forward_s if phase == "forward" else block.backward_s
            if unit not in self.roots:
                # its own gather (if not prefetched), then the prefetch of the next ones
                while issued < min(order.index(unit) + 1 + self.prefetch, len(order)):
                    if order[issued] not in ready:
                        ready[order[issued]] = self.gather(order[issued], phase)
                    issued += 1
                if unit not in used:
                    used.add(unit)
                    if ready[unit] >= 0:  # -1: kept from the forward, nothing to wait for
                        self.use(unit, ready[unit])
            self.rank.compute(seconds)
            if reduce_after is not None and reduce_after.get(unit) == index:
                self.reduce(unit)

    def scratch_bytes(self, machine: MachineProfile) -> int:
        """The collectives' scratch in flight during the backward: the largest unit's
        all-gather (the next unit's prefetch) beside the largest reduce-scatter and, under
        HSDP, the largest all-reduce of a shard."""
        out = 0
        if self.n > 1:
            out += max(machine.scratch_bytes(ALL_GATHER, b) for b in self.gathered)
            out += max(machine.scratch_bytes(REDUCE_SCATTER, g * self.n) for g in self.grads)
        if self.replicas > 1:
            out += max(machine.scratch_bytes(ALL_REDUCE, g) for g in self.grads)
        return out

    @property
    def synced(self) -> float:
        return max(self.rank.t, self.shard.free, self.replicate.free)
