"""The step timeline's parts: one rank's compute clock, a process group's channel, the results.

A step is walked on one rank (``_data_parallel_cost``, ``_zero3_cost``; the pipeline has the
simulator's). Its compute runs on one stream (``Rank``): the model profile's blocks, the
executor's copies into and out of communication buffers (at the machine's copy bandwidth) and
the optimizer. Every collective runs on its process group's ``Channel``, one after the other in
the order the executor issues them (one NCCL stream, one gloo queue), no earlier than its inputs
are ready; while one is in flight, compute runs ``overlap_slowdown`` times slower (the
machine profile's figure for compute and communication sharing a device, per collective kind
where it has one: ``MachineProfile.slowdown``; the largest of those in flight counts). A
collective's *exposed* time is the part of it during which its rank computes nothing; the step
ends with the last collective or the last compute.

Memory is the plan's model states (``estimate_ddp``/``estimate_zero1/2``; ZeRO-3 a walk of
what its executor's step holds, ``_zero3_cost``) at two moments: the backward, where
activations still alive meet the gradients they turn into (``activation_peak``) and the
collectives in flight allocate their scratch, and the optimizer step with its scratch
(docs/cost-model.md).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._memory import MemoryEstimate, RankMemory
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.cost._machine import MachineProfile
from gradsync_core.plan.cost._model_profile import ModelProfile


@dataclass(frozen=True, slots=True, kw_only=True)
class CommEvent:
    """One collective on the timeline: what, over which group, when, and how much of it no
    compute hid."""

    what: str  # "bucket 3", "unit 2 all-gather (backward)", "stage 1 reduce", "1SEND_F3"
    collective: str
    group: str  # "dp", "dp_shard", "dp_replicate", "pp"
    group_size: int
    nbytes: int
    start_s: float
    end_s: float
    exposed_s: float

    def to_json(self) -> dict[str, Any]:
        return {
            "what": self.what,
            "collective": self.collective,
            "group": self.group,
            "group_size": self.group_size,
            "nbytes": self.nbytes,
            "start_s": self.start_s,
            "end_s": self.end_s,
            "exposed_s": self.exposed_s,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class RankCost:
    """One rank's share of a step: its compute, its idle time and its memory.

    ``rank`` is the data-parallel rank (the shard rank under HSDP; the pipeline rank for a
    pipeline). ``memory`` holds the model states (parameters, gradients, optimizer state,
    buckets or gathered units: ``estimate_ddp``/``estimate_zero1/2/3``). Two moments can be
    the peak: the backward, where the model states' peak meets the activations still alive
    (``activation_bytes``: their most beyond the gradients they turn into; None when the
    model profile does not give them), and the optimizer step (``optimizer_peak_bytes``:
    parameters, gradients, state, the buffers that persist and the step's scratch; None when
    the profile does not give the scratch). The backward also holds the scratch its
    collectives in flight allocate (``collective_bytes``: the machine's ``collective_scratch``).
    """

    rank: int
    compute_s: float
    idle_s: float
    memory: RankMemory
    activation_bytes: int | None
    optimizer_peak_bytes: int | None = None
    collective_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        backward = self.memory.peak_bytes + (self.activation_bytes or 0) + self.collective_bytes
        return max(backward, self.optimizer_peak_bytes or 0)

    def to_json(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "compute_s": self.compute_s,
            "idle_s": self.idle_s,
            "memory": self.memory.to_json(),
            "activation_bytes": self.activation_bytes,
            "optimizer_peak_bytes": self.optimizer_peak_bytes,
            "collective_bytes": self.collective_bytes,
            "peak_bytes": self.peak_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class StepCost:
    """The predicted step: its time, what of its communication compute did not hide, every
    collective on the timeline and each rank's memory.

    ``compute_s`` is the critical rank's compute; ``exposed_comm_s = step_s - compute_s``
    the time it waits on communication (or, in a pipeline, on other stages). ``notes`` are
    the approximations in force (a scaled or estimated model profile, activations unknown).
    """

    step_s: float
    compute_s: float
    comms: tuple[CommEvent, ...]
    ranks: tuple[RankCost, ...]
    notes: tuple[str, ...] = ()

    @property
    def exposed_comm_s(self) -> float:
        return max(0.0, self.step_s - self.compute_s)

    @property
    def peak_bytes(self) -> int:
        """The fullest rank's peak."""
        return max(r.peak_bytes for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "compute_s": self.compute_s,
            "exposed_comm_s": self.exposed_comm_s,
            "peak_bytes": self.peak_bytes,
            "notes": list(self.notes),
            "comms": [c.to_json() for c in self.comms],
            "ranks": [r.to_json() for r in self.ranks],
        }


class Channel:
    """One process group's collectives, run one after another in the order they are issued."""

    def __init__(self) -> None:
        self.free = 0.0

    def run(self, ready: float, duration: float) -> tuple[float, float]:
        start = max(self.free, ready)
        self.free = start + duration
        return start, self.free


class Rank:
    """One rank's compute stream, slowed while its collectives are in flight.

    ``compute`` runs work of a given length (as measured alone) from when it is ready;
    ``collective`` puts one on a channel and remembers it, so later compute that overlaps it
    takes the machine's ``slowdown`` of its kind times longer there; ``copy`` is compute at the
    copy bandwidth.
    """

    def __init__(self, machine: MachineProfile) -> None:
        self.machine = machine
        self.t = 0.0
        self.busy: list[tuple[float, float]] = []
        self.flight: list[tuple[float, float, float]] = []  # start, end, slowdown
        self._slowed: list[tuple[float, float, float]] | None = None
        self.comms: list[tuple[str, str, str, int, int, float, float]] = []

    def compute(self, seconds: float, ready: float = 0.0) -> float:
        start = max(self.t, ready)
        self.t = self._advance(start, seconds)
        if self.t > start:
            self.busy.append((start, self.t))
        return self.t

    def copy(self, nbytes: int) -> float:
        return self.compute(self.machine.copy_time(nbytes))

    def wait(self, until: float) -> None:
        self.t = max(self.t, until)

    def collective(
        self,
        channel: Channel,
        what: str,
        kind: str,
        group: str,
        size: int,
        nbytes: int,
        level: str,
        ready: float | None = None,
        mine: bool = True,
    ) -> float:
        """Issue a collective (at ``ready``, default now); returns when it ends. ``mine``:
        this rank's thread issues it, and spends the link's issue time doing so."""
        if mine:
            self.compute(self.machine.issue_time(kind, nbytes, size, level))
        duration = self.machine.time(kind, nbytes, size, level)
        at = self.t if ready is None else max(ready, self.t) if mine else ready
        start, end = channel.run(at, duration)
        if end > start:
            self.flight.append((start, end, self.machine.slowdown(kind)))
            self._slowed = None
        self.comms.append((what, kind, group, size, nbytes, start, end))
        return end

    def _advance(self, start: float, work: float) -> float:
        if not self.flight or work <= 0:
            return start + work
        if self._slowed is None:
            self._slowed = _slowed(self.flight)
        t = start
        for a, b, slow in self._slowed:
            if b <= t:
                continue
            if a > t:
                if t + work <= a:
                    return t + work
                work -= a - t
                t = a
            if work * slow <= b - t:
                return t + work * slow
            work -= (b - t) / slow
            t = b
        return t + work

    def events(self) -> tuple[CommEvent, ...]:
        busy = _merged(self.busy)
        return tuple(
            CommEvent(
                what=what,
                collective=kind,
                group=group,
                group_size=size,
                nbytes=nbytes,
                start_s=start,
                end_s=end,
                exposed_s=uncovered(start, end, busy),
            )
            for what, kind, group, size, nbytes, start, end in self.comms
        )

    @property
    def compute_s(self) -> float:
        return sum(b - a for a, b in self.busy)


def _slowed(flight: Sequence[tuple[float, float, float]]) -> list[tuple[float, float, float]]:
    """The stretches where compute runs slower: ``(start, end, slowdown)``, sorted, disjoint,
    each the largest slowdown of the collectives in flight there (1 left out)."""
    cuts = sorted({t for a, b, _ in flight for t in (a, b)})
    out: list[tuple[float, float, float]] = []
    for a, b in itertools.pairwise(cuts):
        slow = max((s for x, y, s in flight if x <= a and y >= b), default=1.0)
        if slow == 1:
            continue
        if out and out[-1][1] == a and out[-1][2] == slow:
            out[-1] = (out[-1][0], b, slow)
        else:
            out.append((a, b, slow))
    return out


def _merged(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def uncovered(start: float, end: float, busy: Sequence[tuple[float, float]]) -> float:
    """The length of ``[start, end]`` outside the ``busy`` intervals (sorted, disjoint)."""
    covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in busy)
    return max(0.0, end - start - covered)


def level(machine: MachineProfile, topology: Topology, group: str) -> str:
    return machine.level_of(topology.group_at(group, 0))


def profile_at(model: ModelProfile, samples: int | None) -> tuple[ModelProfile, list[str]]:
    """The model profile at ``samples`` per microbatch, and the notes that say how it was
    obtained."""
    notes = []
    if model.source == "flops":
        notes.append(f"model profile: a FLOP estimate ({model.note})")
    if samples is not None and samples != model.samples:
        notes.append(f"model profile scaled from {model.samples} to {samples} samples")
        model = model.scaled(samples)
    if model.activation_bytes is None:
        notes.append("activation sizes not in the model profile: peak memory is model states only")
    return model, notes


def block_numel(specs: Sequence[ParamSpec], model: ModelProfile) -> list[int]:
    """Trainable elements per block of the model profile."""
    numel = [0] * len(model.blocks)
    for spec in specs:
        if spec.requires_grad:
            numel[model.block_of(spec.name)] += spec.numel
    return numel


def activation_peak(model: ModelProfile, gradient_bytes: Sequence[int]) -> int | None:
    """The most activation bytes alive beyond the gradients, over the backward.

    At the end of the forward every block's activations are alive and no gradient is; the
    backward frees a block's activations as its gradients appear (``gradient_bytes``, this
    rank's, per block). The worst moment's activations plus gradients, less all the gradients
    (the model states already count them): 0 when activations are small, the activations
    when gradients are. None when the profile lacks activation sizes.
    """
    sizes = [b.activation_bytes for b in model.blocks]
    if any(a is None for a in sizes):
        return None
    alive = sum(a for a in sizes if a is not None)
    grads = 0
    worst = alive
    for index in reversed(range(len(model.blocks))):
        grads += gradient_bytes[index]
        worst = max(worst, alive + grads)
        alive -= sizes[index] or 0
    return max(0, worst - grads)


def rank_costs(
    memory: MemoryEstimate,
    compute: Sequence[float],
    step: float,
    model: ModelProfile,
    block_numel: Sequence[int],
    owned: Sequence[float],
    *,
    persistent: bool,
    collective_bytes: int = 0,
) -> tuple[RankCost, ...]:
    """Each rank's cost: ``owned[r]`` is the share of the model's elements its optimizer
    steps at once (the step's scratch, ``model.optimizer_bytes`` for the whole model, scales
    with it); ``persistent``: whether the estimate's transient buffers live through the
    optimizer step; ``collective_bytes``: the collectives' scratch in flight during the
    backward."""
    total = sum(block_numel) or 1
    out = []
    for r in memory.ranks:
        grads = [r.gradient_bytes * n // total for n in block_numel]
        resident = r.parameter_bytes + r.gradient_bytes + r.optimizer_state_bytes
        scratch = model.optimizer_bytes
        out.append(
            RankCost(
                rank=r.rank,
                compute_s=compute[r.rank],
                idle_s=step - compute[r.rank],
                memory=r,
                activation_bytes=activation_peak(model, grads),
                optimizer_peak_bytes=None
                if scratch is None
                else resident
                + (r.transient_bytes if persistent else 0)
                + round(scratch * owned[r.rank]),
                collective_bytes=collective_bytes,
            )
        )
    return tuple(out)
