"""The simulator's walk in time order: ranks sharing cores, reductions as rendezvous.

``simulate_pipeline`` runs it when the ranks share the machine's cores (``cores``) or when
the plan's data-parallel replicas run together (``dp``): the validated walk (``_sim``) has
fixed each rank's order; this one runs every rank of every replica from event to event (a
piece of work ends, an input arrives, the last peer of a reduction arrives). In between,
each of the k ranks that has work runs at ``min(1, cores / k)`` of its speed (processor
sharing; every rank at full speed without ``cores``; with ``pinned``, each replica's ranks
share ``cores / dp`` cores of their own, k counting the replica's ranks). A compute waits
for its input (the previous stage's end on the same rank, or its message's send plus
``p2p``) using no core; a send's data leaves when its post ends. A stage's ``REDUCE_GRAD``
is a collective of the stage's copies in the dp replicas: it starts on all of them when the
last one arrives, each does its reduction's work, and it returns on none before every copy's
work is done (an all-reduce ends on no rank before every rank's share is in); a rank waiting
for its peers uses no core.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

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
    Action,
)


@dataclass(frozen=True, slots=True)
class Costs:
    """What a rank's communication and host work cost (``simulate_pipeline``'s arguments)."""

    p2p: float = 0.0
    overhead: float = 0.0
    post: float = 0.0
    receive_post: float = 0.0
    first_forward: float = 0.0
    backward_after_forward: float = 0.0

    def extra(self, leaf: Action, previous: str | None) -> float:
        """The compute time ``leaf`` takes beyond its stage's, after a compute of kind
        ``previous`` on its rank (``None``: the rank's first compute of the step): the
        first forward's ``first_forward``, a full or input backward's
        ``backward_after_forward`` right after a forward."""
        if leaf.kind == FORWARD:
            return self.first_forward if previous is None else 0.0
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT) and previous == FORWARD:
            return self.backward_after_forward
        return 0.0


@dataclass(frozen=True, slots=True)
class _Piece:
    """One stretch of a rank's work: ``work`` seconds on a core of its own, a compute (after
    its input is there) or host work, and the timeline entry it makes (``None``: a
    compute's overhead, which the timeline does not show)."""

    work: float
    action: Action | None
    compute: bool


@dataclass(frozen=True, slots=True)
class Shared:
    """What the walk found, each list over the ranks of every replica (rank ``r`` of replica
    ``d`` at ``d * p + r``): each action's ``(action, start, end)``, each rank's computes
    (``busy``) and host work (``host``), and when the last action ended (``end``)."""

    timeline: list[list[tuple[Action, float, float]]]
    busy: list[float]
    host: list[float]
    end: float


def _pieces(
    actions: Sequence[Action], durations: dict[str, list[float]], costs: Costs
) -> list[_Piece]:
    """A rank's actions as the pieces of work the walk runs, in order."""
    out = []
    previous: str | None = None  # the kind of the rank's last compute
    for action in actions:
        if action.is_compute:
            for leaf in action.leaves:  # an OVERLAP_F_B's two halves, each with its overhead
                out.append(_Piece(costs.overhead, None, compute=False))
                work = durations[leaf.kind][leaf.stage] + costs.extra(leaf, previous)
                out.append(_Piece(work, leaf, compute=True))
                previous = leaf.kind
            continue
        work = 0.0  # UNSHARD, RESHARD
        if action.kind in (SEND_F, SEND_B):
            work = costs.post
        elif action.kind in (RECV_F, RECV_B):
            work = costs.receive_post
        elif action.kind == REDUCE_GRAD:
            work = durations[REDUCE_GRAD][action.stage]
        out.append(_Piece(work, action, compute=False))
    return out


def _rates(
    running: list[int], p: int, dp: int, cores: float | None, pinned: bool
) -> dict[int, float]:
    """Each running rank's speed: processor sharing of ``cores`` among the running ranks
    (of the rank's replica on ``cores / dp`` of its own, ``pinned``)."""
    if cores is None or not running:
        return dict.fromkeys(running, 1.0)
    if not pinned:
        return dict.fromkeys(running, min(1.0, cores / len(running)))
    mates = [0] * dp  # running ranks per replica
    for g in running:
        mates[g // p] += 1
    return {g: min(1.0, cores / dp / mates[g // p]) for g in running}


def share(
    actions: Sequence[Sequence[Action]],
    ranks: tuple[int, ...],
    durations: Sequence[dict[str, list[float]]],
    costs: Costs,
    cores: float | None,
    *,
    pinned: bool = False,
) -> Shared:
    """Run validated actions on ``len(durations)`` replicas sharing ``cores`` cores.

    Args:
        actions: each pipeline rank's actions, checked by ``_sim``'s walk.
        ranks: the pipeline rank of each stage.
        durations: each replica's durations by action kind, one per stage.
        costs: the costs besides the durations (``p2p``, ``overhead``, posts).
        cores: the cores all the replicas' ranks share; ``None``: a core each.
        pinned: each replica's ranks share ``cores / dp`` of them of their own instead.

    Returns:
        The timeline, busy and host time of every replica's ranks, and the last end.
    """
    p, dp, n = len(actions), len(durations), len(ranks)
    g_ranks = p * dp
    pieces = [_pieces(actions[g % p], durations[g // p], costs) for g in range(g_ranks)]
    done: dict[tuple[int, str, int, int], float] = {}  # (replica, kind, stage, mb) -> end
    sent: dict[tuple[int, str, int, int], float] = {}  # (replica, SEND_F/B, stage, mb) -> time
    at = [0] * g_ranks  # each rank's current piece
    left: list[float | None] = [None] * g_ranks  # its work left, once started
    began = [0.0] * g_ranks
    # a reduction, (rank, piece): when the rank arrived at it, and when its own work ended
    arrived: dict[tuple[int, int], float] = {}
    worked: dict[tuple[int, int], float] = {}
    busy, host = [0.0] * g_ranks, [0.0] * g_ranks
    timeline: list[list[tuple[Action, float, float]]] = [[] for _ in range(g_ranks)]
    now = 0.0

    def ready(g: int, leaf: Action) -> float | None:
        """When ``leaf``'s input is on rank g; ``None`` while its peer has yet to send it."""
        d, r = divmod(g, p)
        s, mb = leaf.stage, leaf.microbatch
        assert mb is not None
        if leaf.kind == BACKWARD_WEIGHT:
            return 0.0
        if leaf.kind == FORWARD:
            if s == 0:
                return 0.0
            peer, kinds, send = s - 1, (FORWARD, FORWARD), SEND_F
        else:
            if s == n - 1:
                return 0.0
            peer, kinds, send = s + 1, (FULL_BACKWARD, BACKWARD_INPUT), SEND_B
        if ranks[peer] == r:  # a local hand-over, already done: the walk checked the order
            return next(done[d, k, peer, mb] for k in kinds if (d, k, peer, mb) in done)
        t = sent.get((d, send, peer, mb))
        return None if t is None else t + costs.p2p

    def peers(g: int) -> range:
        """Rank g and its copies in the other replicas: a reduction's participants."""
        return range(g % p, g_ranks, p)

    def start(g: int) -> bool:
        """Start rank g's next piece if it can start now (a reduction: with its peers)."""
        piece = pieces[g][at[g]]
        if piece.compute:
            assert piece.action is not None
            t = ready(g, piece.action)
            if t is None or t > now:
                return False
        elif piece.action is not None and piece.action.kind == REDUCE_GRAD:
            # every replica runs the same actions, so its peers meet at the same piece
            arrived.setdefault((g, at[g]), now)
            if any((q, at[g]) not in arrived for q in peers(g)):
                return False
            for q in peers(g):
                left[q], began[q] = pieces[q][at[q]].work, now
            return True
        left[g], began[g] = piece.work, now
        return True

    def end(g: int) -> bool:
        """End rank g's piece, its work done (a reduction: once its peers' is done too)."""
        piece = pieces[g][at[g]]
        start, worked_until = began[g], now
        if piece.action is not None and piece.action.kind == REDUCE_GRAD:
            worked.setdefault((g, at[g]), now)
            if any((q, at[g]) not in worked for q in peers(g)):
                return False
            start, worked_until = arrived[g, at[g]], worked[g, at[g]]
        if piece.action is not None:
            a, d = piece.action, g // p
            timeline[g].append((a, start, now))
            if piece.compute:
                assert a.microbatch is not None
                done[d, a.kind, a.stage, a.microbatch] = now
            elif a.kind in (SEND_F, SEND_B):
                assert a.microbatch is not None
                sent[d, a.kind, a.stage, a.microbatch] = now
        (busy if piece.compute else host)[g] += worked_until - began[g]
        at[g] += 1
        left[g] = None
        return True

    while True:
        moved = True
        while moved:  # start and end what can start and end now, until nothing changes
            moved = False
            for g in range(g_ranks):
                while at[g] < len(pieces[g]):
                    if left[g] is None:
                        if not start(g):
                            break
                        moved = True
                    if left[g] or not end(g):
                        break
                    moved = True
        running = [g for g in range(g_ranks) if left[g]]
        work = [left[g] or 0.0 for g in range(g_ranks)]
        arrivals = []
        for g in range(g_ranks):
            if at[g] < len(pieces[g]) and left[g] is None and pieces[g][at[g]].compute:
                action = pieces[g][at[g]].action
                assert action is not None
                t = ready(g, action)
                if t is not None:
                    arrivals.append(t)
        if not running and not arrivals:
            break
        rate = _rates(running, p, dp, cores, pinned)
        step = min([work[g] / rate[g] for g in running] + [t - now for t in arrivals])
        for g in running:  # the pieces that end now end exactly
            left[g] = 0.0 if work[g] / rate[g] == step else max(work[g] - step * rate[g], 0.0)
        now += step
    if any(at[g] < len(pieces[g]) for g in range(g_ranks)):  # pragma: no cover - walk checked
        raise AssertionError("the shared walk stopped before the end of a validated plan")
    last = max((t for timed in timeline for _, _, t in timed), default=0.0)
    return Shared(timeline=timeline, busy=busy, host=host, end=max(last, now))
