"""Pipeline validator and simulator: run every rank's actions against the others (docs/pipeline.md).

One walk does both. Each rank takes its actions in order; a forward waits for its input (the
previous stage's output, local or received), a backward for its output gradient; a send is
asynchronous (torch's ``isend``) and its data lands ``p2p`` later; a receive is posted where
it stands and waited on by the compute that consumes it (torch's runtime). Anything that no
timing could make right (a backward before its forward, a receive nobody sends, a weight
gradient before its input gradient, a stage computed while sharded) is refused with a
sentence; ranks that all wait on each other are a deadlock, refused the same way. With
durations the same walk is the simulator: step time, idle time per rank (the bubble) and the
peak number of stashed microbatches per rank. Besides the computes, a rank's own host work
takes time on its clock: a fixed overhead per compute (done before the compute waits for its
input, so a wait hides it), the posting of each send and receive, and each stage's gradient
reduction at ``REDUCE_GRAD`` (all zero by default).

By default every rank has a core of its own and the plan runs alone. Given ``cores``, the
ranks share that many; given ``dp``, that many replicas of the plan run together, each
stage's ``REDUCE_GRAD`` a collective of its copies. Either way the validated walk fixes the
order, then a second walk in time order (``_shared``) runs the ranks' computes and host work
at ``min(1, cores / k)`` of their speed while k of them are runnable (processor sharing); a
rank waiting for its input, or for its peers in a reduction, uses no core.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from gradsync_core.plan.pipeline._actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    SEND_B,
    SEND_F,
    UNSHARD,
    Action,
)
from gradsync_core.plan.pipeline._shared import Costs, share

Times = float | Sequence[float]  # one time for every stage, or one per stage
# ... or, with dp replicas, one list of a time per stage for each replica
ReplicaTimes = Times | Sequence[Sequence[float]]


class PipelineLike(Protocol):
    """What the simulator reads of a plan: a ``PipelinePlan`` (which imports this module, so
    this module names it by its shape)."""

    @property
    def actions(self) -> tuple[tuple[Action, ...], ...]: ...
    @property
    def stage_ranks(self) -> tuple[int, ...]: ...
    @property
    def microbatches(self) -> int: ...
    @property
    def zero3(self) -> bool: ...


_Key = tuple[int, int]  # (stage, microbatch)


@dataclass(frozen=True, slots=True, kw_only=True)
class TimedAction:
    """One action a rank ran, and when (an ``OVERLAP_F_B`` appears as its two parts)."""

    action: Action
    start: float
    end: float


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineSimulation:
    """What one step of a pipeline plan costs, rank by rank.

    Each tuple has an entry per rank: the plan's p ranks, or with ``dp`` replicas those of
    every replica, rank r of replica d at ``d * p + r``. ``busy[r]`` is rank r's compute
    time; ``idle[r]`` is ``step_time - busy[r]``: the bubble of rank r, its waits and its
    host work included. ``host[r]`` is that host work: compute overheads, message posts and
    gradient reductions (the part of ``idle[r]`` a faster host or network would save; the
    rest is waiting). ``peak_stash[r]`` is the most (stage, microbatch) activations rank r
    holds at once: a forward stashes one, its full backward
    (or, split, its weight gradient) frees it.
    """

    step_time: float
    busy: tuple[float, ...]
    idle: tuple[float, ...]
    peak_stash: tuple[int, ...]
    actions: tuple[tuple[TimedAction, ...], ...]
    host: tuple[float, ...]

    @property
    def bubble(self) -> float:
        """Idle time over all ranks' time: ``sum(idle) / (ranks * step_time)``."""
        total = len(self.idle) * self.step_time
        return sum(self.idle) / total if total else 0.0


def simulate_pipeline(
    plan: PipelineLike,
    *,
    forward: ReplicaTimes = 1.0,
    backward: ReplicaTimes = 2.0,
    weight: ReplicaTimes = 1.0,
    p2p: float = 0.0,
    overhead: float = 0.0,
    post: float = 0.0,
    reduce: ReplicaTimes = 0.0,
    receive_post: float | None = None,
    first_forward: float = 0.0,
    backward_after_forward: float = 0.0,
    cores: float | None = None,
    dp: int = 1,
    pinned: bool = False,
) -> PipelineSimulation:
    """Run ``plan`` with these durations and report its step (docs/pipeline.md, "Simulator").

    Args:
        plan: the pipeline plan.
        forward: a stage's forward time on one microbatch (one number, or one per stage).
        backward: a stage's full backward time (input and weight gradients together).
        weight: the weight-gradient half of ``backward``; the input-gradient half (``I``)
            takes ``backward - weight``. Only split schedules (zero bubble) use it.
        p2p: the time from a send to its data at the receiver.
        overhead: the host time of each compute (a forward, a backward, an input or weight
            gradient, each half of an ``OVERLAP_F_B``) outside the compute itself: the
            executor's dispatch and bookkeeping. It runs before the compute waits for its
            input, so a wait hides it.
        post: the host time of posting each send (and each receive, unless
            ``receive_post`` is given); a send's data leaves when its post ends.
        reduce: a stage's ``REDUCE_GRAD`` time on its rank (one number, or one per stage):
            the data-parallel reduction of its gradients and their scaling.
        receive_post: the host time of posting each receive, where it differs from a
            send's (``None``: ``post``).
        first_forward: the compute time each rank's first forward of the step takes beyond
            its stage's ``forward``: the caches the previous step (its optimizer) left cold.
        backward_after_forward: the compute time a full or input backward takes beyond its
            stage's when the rank's previous compute was a forward (a backward after a
            backward takes its stage's time). Both are compute: ``busy`` counts them.
        cores: the cores the ranks share (``None``: one core per rank, the closed forms).
            While k ranks are runnable (computing, or doing host work: overheads, posts,
            reductions) each runs at ``min(1, cores / k)`` of its speed: processor sharing,
            as the operating system shares cores among runnable processes (measured on 2
            cores: docs/pipeline.md, "The simulator"); a rank waiting for its input uses no
            core, and ``p2p`` is a latency that uses none either. The times above are then
            each action's time on a core of its own (its CPU time), and ``busy`` and the
            timeline's ends are stretched by the sharing. A fraction is allowed: ``d``
            identical pipelines on one machine (data-parallel replicas of this plan, with the
            same times) run each as one pipeline on ``cores / d`` cores, their ranks
            runnable at the same moments (``dp`` simulates them together).
        dp: how many data-parallel replicas of the plan run together, all their ranks
            sharing ``cores``. A stage's ``REDUCE_GRAD`` is then a collective of its dp
            copies: it starts on all of them when the last one arrives, takes each its own
            ``reduce`` of work, and returns on none before all of them are done (the wait
            for the peers is idle, not host time). ``forward``, ``backward``, ``weight`` and
            ``reduce`` may then give each replica its own times: a list of dp lists of a
            time per stage. The results cover every replica's ranks (``PipelineSimulation``).
        pinned: with ``cores`` and ``dp``, each replica's ranks share ``cores / dp`` cores
            of their own, as when each replica's processes are pinned to their own cores
            (``benchmarks/torch_pipeline.py`` pins them): a replica waiting in a reduction
            leaves its cores idle rather than lending them to the others (``False``: all
            the replicas' ranks share all ``cores``).

    Returns:
        The step time, per-rank busy, idle and host time, per-rank peak stash and every
        action's start and end.

    Raises:
        ValueError: on negative or non-finite times, ``weight > backward``, a time list
            whose length is not the number of stages (or of replicas), ``cores`` not a
            finite number > 0, ``dp`` not an integer >= 1, or ``pinned`` without ``cores``.

    Example:
        >>> plan = plan_pipeline(schedule="GPipe", microbatches=4, topology=Topology(pp=4),
        ...                      layers=8)
        >>> sim = simulate_pipeline(plan, forward=1, backward=2)
        >>> sim.step_time, round(sim.bubble, 4) == round(3 / 7, 4)
        (21.0, True)
    """
    n = len(plan.stage_ranks)
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise ValueError(f"dp must be an integer >= 1 (the replicas of the plan), got {dp!r}")
    f, b, w, red = (
        _per_replica(name, t, dp, n)
        for name, t in (
            ("forward", forward),
            ("backward", backward),
            ("weight", weight),
            ("reduce", reduce),
        )
    )
    for d in range(dp):
        for s in range(n):
            if w[d][s] > b[d][s]:
                raise ValueError(
                    f"weight time {w[d][s]} exceeds the full backward time {b[d][s]} of stage "
                    f"{s}; the weight gradient is a part of the backward: give weight <= backward"
                )
    if receive_post is None:
        receive_post = post
    for name, value in (
        ("p2p", p2p),
        ("overhead", overhead),
        ("post", post),
        ("receive_post", receive_post),
        ("first_forward", first_forward),
        ("backward_after_forward", backward_after_forward),
    ):
        if isinstance(value, bool) or not (
            isinstance(value, int | float) and math.isfinite(value) and value >= 0
        ):
            raise ValueError(f"{name} must be a finite time >= 0, got {value!r}")
    if cores is not None and (
        isinstance(cores, bool)
        or not isinstance(cores, int | float)
        or not math.isfinite(cores)
        or cores <= 0
    ):
        raise ValueError(
            f"cores must be a finite number > 0 (or None: a core per rank), got {cores!r}"
        )
    if not isinstance(pinned, bool):
        raise ValueError(f"pinned must be True or False, got {pinned!r}")
    if pinned and cores is None:
        raise ValueError(
            "pinned=True shares cores / dp cores among each replica's ranks, but cores is "
            "None (a core per rank); give cores, or leave pinned False"
        )
    replicas = [
        {
            FORWARD: f[d],
            FULL_BACKWARD: b[d],
            BACKWARD_WEIGHT: w[d],
            BACKWARD_INPUT: [b[d][s] - w[d][s] for s in range(n)],
            REDUCE_GRAD: red[d],
        }
        for d in range(dp)
    ]
    costs = Costs(
        p2p=float(p2p),
        overhead=float(overhead),
        post=float(post),
        receive_post=float(receive_post),
        first_forward=float(first_forward),
        backward_after_forward=float(backward_after_forward),
    )
    sim = _walk(
        plan.actions,
        plan.stage_ranks,
        plan.microbatches,
        zero3=plan.zero3,
        durations=replicas[0],
        costs=costs,
    )
    if cores is None and dp == 1:
        return sim
    walked = share(
        plan.actions,
        plan.stage_ranks,
        replicas,
        costs,
        None if cores is None else float(cores),
        pinned=pinned,
    )
    return PipelineSimulation(
        step_time=walked.end,
        busy=tuple(walked.busy),
        idle=tuple(walked.end - b for b in walked.busy),
        peak_stash=sim.peak_stash * dp,
        actions=tuple(
            tuple(TimedAction(action=a, start=s, end=e) for a, s, e in timed)
            for timed in walked.timeline
        ),
        host=tuple(walked.host),
    )


def check_actions(
    actions: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    microbatches: int,
    *,
    zero3: bool,
) -> tuple[int, ...]:
    """Refuse actions that cannot run as one step: the pipeline validator.

    Every stage runs a forward and a backward (full, or input then weight gradient) of every
    microbatch on its own rank, each after its inputs; every send has its receive, posted in
    the same order on both ranks of a pair; each stage reduces its gradients once, after its
    last backward; with ``zero3`` a stage is computed only while unsharded, and ends
    resharded; and the ranks never all wait on each other.

    Args:
        actions: each pipeline rank's actions, in order.
        ranks: the pipeline rank of each stage.
        microbatches: how many microbatches the step runs.
        zero3: whether the stages' parameters are sharded (``UNSHARD``/``RESHARD`` expected).

    Returns:
        The peak number of stashed microbatches per rank.

    Raises:
        ValueError: naming the first rule broken, the rank and the action.
    """
    zeros = [0.0] * len(ranks)
    durations = {
        k: zeros for k in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, REDUCE_GRAD)
    }
    sim = _walk(
        actions, tuple(ranks), microbatches, zero3=zero3, durations=durations, costs=Costs()
    )
    return sim.peak_stash


def _per_stage(name: str, times: Times, n: int) -> list[float]:
    values = [times] * n if isinstance(times, int | float) else list(times)
    if len(values) != n:
        raise ValueError(f"{name} has {len(values)} times for {n} stages; give one per stage")
    for t in values:
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise ValueError(f"{name} times must be finite numbers >= 0, got {t!r}")
    return [float(t) for t in values]


def _per_replica(name: str, times: ReplicaTimes, dp: int, n: int) -> list[list[float]]:
    """``times`` for each replica: one per stage (``_per_stage``) for all, or a list each."""
    if isinstance(times, int | float) or not any(isinstance(t, Sequence) for t in times):
        return [_per_stage(name, times, n)] * dp  # type: ignore[arg-type]
    if len(times) != dp:
        raise ValueError(
            f"{name} has {len(times)} lists of times for {dp} replicas; give one list per "
            "replica (dp), or one time per stage for all of them"
        )
    return [_per_stage(name, t, n) for t in times]


def _walk(
    actions: Sequence[Sequence[Action]],
    ranks: tuple[int, ...],
    m: int,
    *,
    zero3: bool,
    durations: dict[str, list[float]],
    costs: Costs,
) -> PipelineSimulation:
    """Run every rank as far as its inputs allow, round after round, until all are done."""
    p, n = len(actions), len(ranks)
    state = _State(p, n, m, ranks, zero3, durations, costs)
    pos = [0] * p
    while any(pos[r] < len(actions[r]) for r in range(p)):
        progress = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                if not state.run(r, actions[r][pos[r]]):
                    break
                pos[r] += 1
                progress = True
        if not progress:
            blocked = [(r, actions[r][pos[r]]) for r in range(p) if pos[r] < len(actions[r])]
            waits = "; ".join(
                f"rank {r} waits at {a} for {state.waiting_for(r, a)}" for r, a in blocked
            )
            raise ValueError(
                f"deadlock: {waits}; reorder the actions so that each input is sent before "
                "its receiver waits on it"
            )
    state.finish()
    step = max(state.clock, default=0.0)
    return PipelineSimulation(
        step_time=step,
        busy=tuple(state.busy),
        idle=tuple(step - busy for busy in state.busy),
        peak_stash=tuple(state.peak),
        actions=tuple(tuple(timed) for timed in state.timeline),
        host=tuple(state.host),
    )


class _State:
    """Everything the walk has seen: what ran where and when, sends, receives, shards."""

    def __init__(
        self,
        p: int,
        n: int,
        m: int,
        ranks: tuple[int, ...],
        zero3: bool,
        durations: dict[str, list[float]],
        costs: Costs,
    ) -> None:
        self.p, self.n, self.m, self.ranks, self.zero3 = p, n, m, ranks, zero3
        self.durations, self.costs = durations, costs
        self.clock = [0.0] * p
        self.busy = [0.0] * p
        self.host = [0.0] * p
        self.stash = [0] * p
        self.peak = [0] * p
        self.timeline: list[list[TimedAction]] = [[] for _ in range(p)]
        self.previous: list[str | None] = [None] * p  # the kind of each rank's last compute
        self.done: dict[str, dict[_Key, float]] = {
            k: {} for k in (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
        }
        self.sent: dict[tuple[str, int, int], float] = {}  # (SEND_F/SEND_B, stage, mb) -> time
        self.posted: set[tuple[str, int, int]] = set()
        self.consumed: set[tuple[str, int, int]] = set()
        self.pairs: dict[tuple[int, int, str], list[tuple[str, int, int]]] = {}
        self.unsharded: set[int] = set()
        self.finished = [0] * n  # backwards that completed a microbatch's gradient, per stage
        self.reduced: set[int] = set()

    # -- readiness -------------------------------------------------------------------------

    def _input(self, r: int, leaf: Action) -> float | None:
        """When ``leaf``'s input is on rank r; ``None`` while a peer has yet to send it."""
        s, mb = leaf.stage, leaf.microbatch
        assert mb is not None
        if leaf.kind == FORWARD:
            if s == 0:
                return 0.0
            return self._from(r, leaf, s - 1, FORWARD, (FORWARD,), RECV_F, SEND_F)
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT):
            if (s, mb) not in self.done[FORWARD]:
                raise ValueError(f"rank {r} runs {leaf} before the forward {s}F{mb}")
            if s == self.n - 1:
                return 0.0  # the loss is computed with the last forward
            return self._from(
                r, leaf, s + 1, "backward", (FULL_BACKWARD, BACKWARD_INPUT), RECV_B, SEND_B
            )
        if (s, mb) in self.done[FULL_BACKWARD]:
            raise ValueError(
                f"rank {r} runs {leaf} after the full backward {s}B{mb} already did it"
            )
        if (s, mb) not in self.done[BACKWARD_INPUT]:
            raise ValueError(f"rank {r} runs {leaf} before the input gradient {s}I{mb}")
        return 0.0

    def _from(
        self,
        r: int,
        leaf: Action,
        peer: int,
        what: str,
        kinds: tuple[str, ...],
        recv: str,
        send: str,
    ) -> float | None:
        s, mb = leaf.stage, leaf.microbatch
        assert mb is not None
        if self.ranks[peer] == r:  # neighbouring stages on one rank: a local hand-over
            for kind in kinds:
                if (peer, mb) in self.done[kind]:
                    return self.done[kind][peer, mb]
            raise ValueError(
                f"rank {r} runs {leaf} before the {what} of stage {peer} on microbatch {mb}, "
                "which feeds it on the same rank"
            )
        if (recv, s, mb) not in self.posted or (recv, s, mb) in self.consumed:
            raise ValueError(
                f"rank {r} runs {leaf} without receiving its input first: put {s}{recv}{mb} "
                "before it"
            )
        sent = self.sent.get((send, peer, mb))
        return None if sent is None else sent + self.costs.p2p

    def waiting_for(self, r: int, action: Action) -> str:
        for leaf in action.leaves:
            if leaf.kind == BACKWARD_WEIGHT or self._input(r, leaf) is not None:
                continue
            peer, send = (
                (leaf.stage - 1, SEND_F) if leaf.kind == FORWARD else (leaf.stage + 1, SEND_B)
            )
            return f"{peer}{send}{leaf.microbatch} on rank {self.ranks[peer]}"
        return "nothing"  # pragma: no cover - only blocked actions are asked about

    # -- running one action ----------------------------------------------------------------

    def run(self, r: int, action: Action) -> bool:
        """Run ``action`` on rank r if its inputs are there; ``False`` if it must wait."""
        for leaf in action.leaves:
            self._check_place(r, leaf)
        if action.is_compute:
            return self._compute(r, action)
        self._other(r, action)
        return True

    def _check_place(self, r: int, leaf: Action) -> None:
        if leaf.stage >= self.n:
            raise ValueError(f"rank {r} has {leaf}, but there are only {self.n} stages")
        if leaf.microbatch is not None and leaf.microbatch >= self.m:
            raise ValueError(f"rank {r} has {leaf}, but the step runs {self.m} microbatches")
        if self.ranks[leaf.stage] != r:
            raise ValueError(
                f"rank {r} has {leaf}, but stage {leaf.stage} runs on rank {self.ranks[leaf.stage]}"
            )

    def _compute(self, r: int, action: Action) -> bool:
        ready = []
        for leaf in action.leaves:
            if self.zero3 and leaf.stage not in self.unsharded:
                raise ValueError(
                    f"rank {r} runs {leaf} while stage {leaf.stage} is sharded: UNSHARD it first"
                )
            key = (leaf.stage, leaf.microbatch)
            if key in self.done[leaf.kind] or (
                leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT)
                and key
                in self.done[FULL_BACKWARD if leaf.kind == BACKWARD_INPUT else BACKWARD_INPUT]
            ):
                raise ValueError(f"rank {r} runs {leaf} twice")
            at = self._input(r, leaf)
            if at is None:
                return False
            ready.append(at)
        for leaf, at in zip(action.leaves, ready, strict=True):
            s, mb = leaf.stage, leaf.microbatch
            assert mb is not None
            if leaf.kind != BACKWARD_WEIGHT and leaf.kind != FORWARD and s != self.n - 1:
                if self.ranks[s + 1] != r:
                    self.consumed.add((RECV_B, s, mb))
            if leaf.kind == FORWARD and s != 0 and self.ranks[s - 1] != r:
                self.consumed.add((RECV_F, s, mb))
            # the host work first (a wait for the input hides it), then the compute
            self.host[r] += self.costs.overhead
            start = max(self.clock[r] + self.costs.overhead, at)
            extra = self.costs.extra(leaf, self.previous[r])
            end = start + self.durations[leaf.kind][s] + extra
            self.previous[r] = leaf.kind
            self.clock[r] = end
            self.busy[r] += end - start
            self.done[leaf.kind][s, mb] = end
            self.timeline[r].append(TimedAction(action=leaf, start=start, end=end))
            if leaf.kind == FORWARD:
                self.stash[r] += 1
                self.peak[r] = max(self.peak[r], self.stash[r])
            elif leaf.kind in (FULL_BACKWARD, BACKWARD_WEIGHT):
                self.stash[r] -= 1
                self.finished[s] += 1
        return True

    def _other(self, r: int, action: Action) -> None:
        s, mb, kind = action.stage, action.microbatch, action.kind
        start, took = self.clock[r], 0.0
        if kind in (SEND_F, SEND_B, RECV_F, RECV_B):
            assert mb is not None
            took = self.costs.post if kind in (SEND_F, SEND_B) else self.costs.receive_post
            self.clock[r] += took  # a send's data leaves when its post ends
            self._comm(r, action, s, mb)
        elif kind == REDUCE_GRAD:
            took = self.durations[REDUCE_GRAD][s]
            self.clock[r] += took
            if s in self.reduced:
                raise ValueError(f"rank {r} reduces the gradients of stage {s} twice")
            if self.finished[s] != self.m:
                raise ValueError(
                    f"rank {r} reduces the gradients of stage {s} after {self.finished[s]} of "
                    f"{self.m} backwards: put {action} after its last backward"
                )
            self.reduced.add(s)
        elif not self.zero3:
            raise ValueError(
                f"rank {r} has {action}, but the plan does not shard parameters (zero3=False)"
            )
        elif kind == UNSHARD:
            if s in self.unsharded:
                raise ValueError(f"rank {r} unshards stage {s} twice without a RESHARD between")
            self.unsharded.add(s)
        else:
            if s not in self.unsharded:
                raise ValueError(f"rank {r} reshards stage {s}, which is not unsharded")
            self.unsharded.remove(s)
        self.host[r] += took
        self.timeline[r].append(TimedAction(action=action, start=start, end=self.clock[r]))

    def _comm(self, r: int, action: Action, s: int, mb: int) -> None:
        kind = action.kind
        peer = s + 1 if kind in (SEND_F, RECV_B) else s - 1
        if not 0 <= peer < self.n or self.ranks[peer] == r:
            raise ValueError(
                f"rank {r} has {action}, but stage {s} has no neighbour on another rank that way"
            )
        if kind == SEND_F and (s, mb) not in self.done[FORWARD]:
            raise ValueError(f"rank {r} sends {action} before computing the forward {s}F{mb}")
        if kind == SEND_B and not (
            (s, mb) in self.done[FULL_BACKWARD] or (s, mb) in self.done[BACKWARD_INPUT]
        ):
            raise ValueError(f"rank {r} sends {action} before computing the backward {s}B{mb}")
        key = (kind, s, mb)
        if key in self.sent or key in self.posted:
            raise ValueError(f"rank {r} has {action} twice")
        if kind in (SEND_F, SEND_B):
            self.sent[key] = self.clock[r]
            # (rank from, rank to, side) -> the messages in the order that side posts them
            self.pairs.setdefault((r, self.ranks[peer], "send"), []).append((kind[-1], s, mb))
        else:
            self.posted.add(key)
            # a receive for stage s matches the peer's send from stage ``peer``
            self.pairs.setdefault((self.ranks[peer], r, "recv"), []).append((kind[-1], peer, mb))

    # -- the end of the step ---------------------------------------------------------------

    def finish(self) -> None:
        for s in range(self.n):
            for mb in range(self.m):
                key = (s, mb)
                if key not in self.done[FORWARD]:
                    raise ValueError(f"stage {s} never runs the forward {s}F{mb}")
                split = key in self.done[BACKWARD_INPUT]
                if not split and key not in self.done[FULL_BACKWARD]:
                    raise ValueError(f"stage {s} runs no backward of microbatch {mb}")
                if split and key not in self.done[BACKWARD_WEIGHT]:
                    raise ValueError(f"stage {s} never runs the weight gradient {s}W{mb}")
            if s not in self.reduced:
                raise ValueError(
                    f"stage {s} never reduces its gradients: add {s}{REDUCE_GRAD} after its "
                    "last backward"
                )
        if self.unsharded:
            left = ", ".join(map(str, sorted(self.unsharded)))
            raise ValueError(f"stages {left} end the step unsharded: RESHARD them")
        unread = self.posted - self.consumed
        if unread:
            kind, s, mb = min(unread)
            raise ValueError(f"the receive {s}{kind}{mb} is posted but no compute consumes it")
        for (src, dst, side), order in self.pairs.items():
            if side == "send" and order != self.pairs.get((src, dst, "recv"), []):
                raise ValueError(
                    f"rank {src} sends to rank {dst} in another order than rank {dst} posts "
                    "its receives; point-to-point messages match in order, so put the "
                    "receives in the order of the sends"
                )
