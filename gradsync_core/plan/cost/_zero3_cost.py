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
machine's ``step_host_s["zero3"]``) runs, then the optimizer.

With overlap the step is ``fully_shard``'s (gradsync_torch), which does more on the rank's
thread than issue its collectives:

- a unit's own gather is waited for before the next unit's prefetch is issued (its forward
  and pre-backward hooks), and issuing a reduce-scatter first waits for the one before it (at
  most one unit's send buffer waits at a time, as in FSDP2); under HSDP a unit's all-reduce
  over the replicas is issued when its reduce-scatter is waited for there, or at the
  backward's end;
- the runtime agreement (gradsync_torch ``param_sharding/_agreement.py``): each check is one
  blocking all-gather of a 32-byte digest per rank over the group it agrees on, queued on that
  group's channel behind the collectives in flight (gloo runs a group's collectives in
  order). Under HSDP every collective is checked, each over its own group; without HSDP the
  ranks check once at the backward's start and once at its end (``AGREEMENT_BYTES``).

Memory depends on the executor, and each is a walk of what its step holds, moment by moment.
``"torch"``: ``fully_shard``'s hooks allocate and free buffers in the order above;
``torch_peak`` (``_zero3_memory.py``) follows them (its docstring lists every buffer and when
it lives). ``"jax"``: ``zero3_step`` is one XLA program, jitted with the parameters and
optimizer state donated, whose buffers live exactly as long as the schedule reads them;
``xla_peak`` walks that schedule (its docstring says what it assumes, each point read off
XLA:CPU's buffer assignment of the step). ``estimate_zero3`` (``gradsync plan --zero``) stays
what it says: a bound over the phases' maxima, which needs no model profile.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gradsync_core.plan._memory import (
    _trainable_rows_numel,
    estimate_zero3,
)
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
from gradsync_core.plan.cost._zero3_memory import torch_peak, xla_peak

AGREEMENT_BYTES = 32  # a SHA-256 digest: what each rank sends in one runtime agreement check
EXECUTORS = ("torch", "jax")  # whose ZeRO-3 step: fully_shard, or zero3_step's XLA program


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
    executor: str = "torch",
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
        executor: whose step the memory is: ``"torch"`` (``fully_shard``) or ``"jax"``
            (``zero3_step``, one XLA program with its parameters and optimizer state
            donated; ``xla_peak``).

    Returns:
        The step's time, its collectives and per-shard-rank memory.

    Raises:
        ValueError: a plan that does not match the topology, a block whose parameters lie in
            two units, a parameter in no block, a group the machine profile lacks, or an
            unknown executor.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor {executor!r} is not one of {', '.join(EXECUTORS)}; pick one")
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
    if executor == "jax":  # XLA combines HSDP's all-reduces over the replicas into one
        walk.combined = 0
    unit_of_block = _units_of_blocks(plan, model)
    walk.run(model, unit_of_block, reshard_after_forward)
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
    if executor == "jax":
        memory, activations = xla_peak(plan, memory, model, unit_of_block, reshard_after_forward)
        scratch = 0
    else:
        memory, activations, scratch = torch_peak(
            plan,
            memory,
            model,
            unit_of_block,
            machine=machine,
            reshard=reshard_after_forward,
            prefetch=prefetch if overlap else 0,
            overlap=overlap,
            tied=tied,
        )
    ranks = rank_costs(
        memory,
        [compute - step_of[slowest] + s for s in step_of],
        rank.t,
        model,
        block_numel(specs, model),
        [k / total for k in shares],
        persistent=False,
        collective_bytes=scratch,
    )
    ranks = tuple(replace(r, activation_bytes=activations) for r in ranks)  # the walk's
    return StepCost(
        step_s=rank.t,
        compute_s=compute,
        comms=rank.events(),
        ranks=ranks,
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
    all-reduces on the replicate group's, compute on the rank. With ``overlap`` the rank
    follows ``fully_shard``'s hooks (the module's docstring); without, each collective is
    waited for where it is issued."""

    def __init__(
        self,
        plan: ParamShardPlan,
        machine: MachineProfile,
        topology: Topology,
        *,
        overlap: bool,
        prefetch: int,
    ) -> None:
        self.machine = machine
        self.n, self.replicas = plan.shard_size, plan.replicate_size
        self.overlap = overlap
        self.prefetch = prefetch if overlap else 0
        # fully_shard checks each collective under HSDP, else once per phase
        self.agree_each = overlap and self.replicas > 1
        self.agree_phases = overlap and self.replicas == 1 and self.n > 1
        self.shard_level = level(machine, topology, "dp_shard")
        self.replicate_level = level(machine, topology, "dp_replicate")
        self.gathered = [plan.unit_padded_nbytes(u.index) * self.n for u in plan.units]
        self.grads = [plan.unit_padded_nbytes(u.index, trainable_only=True) for u in plan.units]
        self.roots = {u.index for u in plan.units if u.prefix == ROOT}
        self.shard, self.replicate = Channel(), Channel()
        self.rank = Rank(machine)
        self.in_flight: tuple[int, float] | None = None  # the reduce-scatter not waited for
        # JAX: the gradient bytes whose all-reduce over the replicas XLA combines into one at
        # the backward's end (None: each unit's own, as fully_shard issues them)
        self.combined: int | None = None

    def agree(self, replicate: bool, before: str) -> None:
        """One runtime agreement check: a blocking all-gather of ``AGREEMENT_BYTES`` per rank
        over the shard group (or the replicate group), behind what that channel runs. The
        link's time runs from the call to the end (as calibrate times it), so a blocking
        call's issue is inside it: the rank waits that long and spends nothing besides."""
        size = self.replicas if replicate else self.n
        if size == 1:
            return
        channel = self.replicate if replicate else self.shard
        where = self.replicate_level if replicate else self.shard_level
        group = "dp_replicate" if replicate else "dp_shard"
        nbytes = AGREEMENT_BYTES * size
        rank = self.rank
        what = f"agreement before {before}"
        end = rank.collective(
            channel, what, ALL_GATHER, group, size, nbytes, where, ready=rank.t, mine=False
        )
        rank.wait(end)

    def gather(self, unit: int, phase: str) -> float:
        what = f"unit {unit} all-gather ({phase})"
        if self.agree_each:
            self.agree(False, what)
        return self.rank.collective(
            self.shard, what, ALL_GATHER, "dp_shard", self.n, self.gathered[unit], self.shard_level
        )

    def use(self, unit: int, ready: float) -> None:
        """Wait for a unit's gather, then copy it out of the gather buffer."""
        self.rank.wait(ready)
        self.rank.copy(self.gathered[unit])

    def reduce(self, unit: int) -> None:
        """A unit's backward is done: reduce-scatter its gradients (with overlap, after
        waiting for the reduce-scatter before it: ``fully_shard``'s ``start_reduce``)."""
        rank = self.rank
        if self.overlap:
            self.finish_reduce()
        rank.copy(self.grads[unit] * self.n)  # the gradients into the reduce-scatter's input
        what = f"unit {unit} reduce-scatter"
        if self.agree_each:
            self.agree(False, what)
        end = rank.collective(
            self.shard,
            what,
            REDUCE_SCATTER,
            "dp_shard",
            self.n,
            self.grads[unit] * self.n,
            self.shard_level,
        )
        if self.overlap:
            self.in_flight = (unit, end)
            return
        if self.replicas > 1 and self.combined is not None:
            self.combined += self.grads[unit]
        elif self.replicas > 1:
            end = self.all_reduce(unit, end)
        rank.wait(end)

    def all_reduce(self, unit: int, ready: float) -> float:
        """HSDP: the unit's reduce-scattered shard all-reduced over the replicas."""
        what = f"unit {unit} all-reduce"
        if self.agree_each:
            self.agree(True, what)
        return self.rank.collective(
            self.replicate,
            what,
            ALL_REDUCE,
            "dp_replicate",
            self.replicas,
            self.grads[unit],
            self.replicate_level,
            ready=ready,
        )

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter in flight; under HSDP issue its all-reduce."""
        if self.in_flight is None:
            return
        unit, end = self.in_flight
        self.in_flight = None
        self.rank.wait(end)
        if self.replicas > 1:
            self.all_reduce(unit, end)

    def run(self, model: ModelProfile, unit_of_block: Sequence[int], reshard: bool) -> None:
        """Forward then backward, in FSDP2's gather, prefetch and reduce order."""
        order = list(dict.fromkeys(u for u in unit_of_block if u not in self.roots))
        for unit in sorted(self.roots):  # a root without parameters gathers nothing
            if self.gathered[unit]:
                self.use(unit, self.gather(unit, "forward"))
        self._phase(model, unit_of_block, order, {}, "forward", range(len(model.blocks)))
        if self.agree_phases:  # the first pre-backward: the forward's check
            self.agree(False, "the backward")
        backward = list(reversed(order))
        again: dict[int, float] = {} if reshard else {u: -1.0 for u in order}
        first = {u: unit_of_block.index(u) for u in order}
        blocks = reversed(range(len(model.blocks)))
        self._phase(model, unit_of_block, backward, again, "backward", blocks, first)
        for unit in sorted(self.roots):  # the root reduces once the whole backward is done
            if self.grads[unit]:
                self.reduce(unit)
        self.finish_reduce()
        if self.replicas > 1 and self.combined:  # JAX: one all-reduce of every shard
            what = "all-reduce (combined)"
            self.rank.wait(
                self.rank.collective(
                    self.replicate,
                    what,
                    ALL_REDUCE,
                    "dp_replicate",
                    self.replicas,
                    self.combined,
                    self.replicate_level,
                )
            )
        if self.agree_phases:  # the backward's check, once its collectives are done
            self.rank.wait(self.synced)
            self.agree(False, "the optimizer step")

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
            if unit not in self.roots and unit not in used:
                # its own gather (if not prefetched), waited for; then the prefetch of the
                # next ones, as fully_shard's pre-forward and pre-backward hooks do
                position = order.index(unit)
                while issued <= position:
                    if order[issued] not in ready:
                        ready[order[issued]] = self.gather(order[issued], phase)
                    issued += 1
                used.add(unit)
                if ready[unit] >= 0:  # -1: kept from the forward, nothing to wait for
                    self.use(unit, ready[unit])
                while issued < min(position + 1 + self.prefetch, len(order)):
                    if order[issued] not in ready:
                        ready[order[issued]] = self.gather(order[issued], phase)
                    issued += 1
            self.rank.compute(seconds)
            if reduce_after is not None and reduce_after.get(unit) == index:
                self.reduce(unit)

    @property
    def synced(self) -> float:
        return max(self.rank.t, self.shard.free, self.replicate.free)
