"""The schedules: each rank's compute order, then torch's lowering passes (docs/pipeline.md).

Every schedule torch 2.13 ships, computed as torch computes it so the per-rank order is
torch's, action for action: for the runtime schedules (looped BFS, interleaved 1F1B,
interleaved zero bubble, ZBV, DualPipeV) ``_calculate_single_rank_operations``; for GPipe and
1F1B what ``_step_microbatches`` runs (their ``_get_pipeline_order`` only illustrates). Where
torch refuses a combination this refuses it too, with a sentence. Then torch's lowering:
``UNSHARD``/``RESHARD`` around each stage's compute (ZeRO-3), ``REDUCE_GRAD`` after each
stage's last backward, and the sends and receives, placed as ``_add_send_recv`` places them.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync_core._pipeline_actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    Action,
)

# torch's names (``get_schedule_class``), read case-insensitively, plus the papers' names.
SCHEDULES = (
    "GPipe",
    "1F1B",
    "Interleaved1F1B",
    "LoopedBFS",
    "InterleavedZeroBubble",
    "ZBVZeroBubble",
    "DualPipeV",
)
_ALIASES = {"zb1p": "InterleavedZeroBubble", "zbv": "ZBVZeroBubble"}
SINGLE_STAGE = ("GPipe", "1F1B")  # torch's PipelineScheduleSingle: one stage per rank
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # two stages per rank, placed in a V

Orders = list[list[Action]]


def schedule_name(name: str) -> str:
    """torch's spelling of schedule ``name`` (any case; ``ZB1P`` and ``ZBV`` accepted).

    Raises:
        ValueError: for a schedule torch does not ship.
    """
    known = {s.lower(): s for s in SCHEDULES} | _ALIASES
    if not isinstance(name, str) or name.lower() not in known:
        raise ValueError(
            f"unknown schedule {name!r}; schedules are {', '.join(SCHEDULES)} (torch's names, "
            "any case; ZB1P and ZBV also accepted)"
        )
    return known[name.lower()]


def default_stages_per_rank(schedule: str) -> int:
    """Two for the multi-stage schedules (the V ones need exactly two), one otherwise."""
    return 1 if schedule in SINGLE_STAGE else 2


def placement_of(schedule: str) -> str:
    """``"v"`` for ZBV and DualPipeV (stage s and 2p-1-s share a rank), else ``"loop"``."""
    return "v" if schedule in V_SHAPED else "loop"


def stage_ranks(pp: int, num_stages: int, placement: str) -> tuple[int, ...]:
    """The pipeline rank of each stage: torch's ``generate_stage_to_rank_mapping``.

    Loop placement puts stage s on rank ``s % pp``; V placement walks the ranks down and back
    up, so the first and last stages share rank 0.

    Example:
        >>> stage_ranks(4, 8, "loop"), stage_ranks(4, 8, "v")
        ((0, 1, 2, 3, 0, 1, 2, 3), (0, 1, 2, 3, 3, 2, 1, 0))
    """
    if num_stages % pp:
        raise ValueError(
            f"{num_stages} stages do not divide evenly over pp = {pp} ranks; give a multiple "
            "of pp stages"
        )
    if placement == "loop":
        return tuple(s % pp for s in range(num_stages))
    if placement != "v":
        raise ValueError(f"placement must be 'loop' or 'v', got {placement!r}")
    ranks, rank = [], 0
    for s in range(num_stages):
        ranks.append(rank)
        if (s + 1) % pp:
            rank += 1 if (s // pp) % 2 == 0 else -1
    return tuple(ranks)


def compute_orders(schedule: str, pp: int, microbatches: int, stages_per_rank: int) -> Orders:
    """Each rank's compute actions in order, as torch's schedule ``schedule`` runs them.

    Raises:
        ValueError: where torch refuses the combination, in one sentence.
    """
    p, m, v = pp, microbatches, stages_per_rank
    if schedule in SINGLE_STAGE and v != 1:
        raise ValueError(
            f"{schedule} runs one stage per rank (torch's PipelineScheduleSingle), got "
            f"{v}; use LoopedBFS or Interleaved1F1B for several stages per rank"
        )
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"{schedule} requires exactly 2 stages per rank (torch's rule), got {v}")
    if schedule == "GPipe":
        return [_gpipe(r, m) for r in range(p)]
    if schedule == "1F1B":
        if m < p:
            raise ValueError(
                f"1F1B needs at least as many microbatches as stages (torch's rule): got {m} "
                f"microbatches for {p} stages; raise --microbatches to {p} or use GPipe"
            )
        return [_one_f_one_b(r, p, m) for r in range(p)]
    if schedule == "LoopedBFS":
        return [_looped_bfs(r, p, m, v) for r in range(p)]
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(
                f"{schedule} needs the microbatches to be a multiple of the number of rounds "
                f"max(1, m // pp) = {rounds} (torch's rule), got {m}; use a multiple of {p} "
                f"or fewer than {2 * p} microbatches"
            )
        zero_bubble = schedule == "InterleavedZeroBubble"
        return [_interleaved(r, p, m, v, m // rounds, zero_bubble) for r in range(p)]
    if schedule == "ZBVZeroBubble":
        return [_zbv(r, p, m) for r in range(p)]
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least as many microbatches as stages (torch's rule): got {m} "
            f"microbatches for {2 * p} stages; raise --microbatches to {2 * p}"
        )
    return [_dualpipe_v(r, p, m) for r in range(p)]


def _gpipe(rank: int, m: int) -> list[Action]:
    """All forwards, then all backwards: torch's ``ScheduleGPipe._step_microbatches``."""
    return [Action(rank, FORWARD, i) for i in range(m)] + [
        Action(rank, FULL_BACKWARD, i) for i in range(m)
    ]


def _one_f_one_b(rank: int, p: int, m: int) -> list[Action]:
    """``Schedule1F1B._step_microbatches``: ``p - rank`` warm-up forwards, then a backward and
    a forward in turn, then the remaining backwards (PipeDream-Flush, arXiv:2006.09503)."""
    warmup = min(m, p - rank)
    ops = [Action(rank, FORWARD, i) for i in range(warmup)]
    forward = warmup
    for backward in range(m):
        ops.append(Action(rank, FULL_BACKWARD, backward))
        if forward < m:
            ops.append(Action(rank, FORWARD, forward))
            forward += 1
    return ops


def _looped_bfs(rank: int, p: int, m: int, v: int) -> list[Action]:
    """Breadth first (arXiv:2211.05953): every microbatch through one local stage before the
    next; backwards in reverse, torch's ``ScheduleLoopedBFS``."""
    stages = range(rank, p * v, p)
    ops = [Action(s, FORWARD, i) for s in stages for i in range(m)]
    return ops + [Action(s, FULL_BACKWARD, i) for s in reversed(stages) for i in reversed(range(m))]


def _interleaved(
    rank: int, p: int, m: int, v: int, per_round: int, zero_bubble: bool
) -> list[Action]:
    """torch's interleaved 1F1B (arXiv:2104.04473) and interleaved zero bubble (ZB1P,
    arXiv:2401.10241): ``_get_warmup_ops`` then ``_get_1f1b_rank_ops``."""
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (p - 1 - rank), m * v)
    total = m * v
    fwd_bwd = total - warmup

    def forward_stage(op: int) -> int:
        return (op // per_round) % v * p + rank

    def backward_stage(op: int) -> int:
        return (v - 1 - ((op - warmup) // per_round) % v) * p + rank

    backward = BACKWARD_INPUT if zero_bubble else FULL_BACKWARD
    counts: dict[tuple[str, int], int] = {}

    def next_mb(kind: str, stage: int) -> int:
        mb = counts.get((kind, stage), 0)
        counts[kind, stage] = mb + 1
        return mb

    ops: list[Action] = []
    backward_ops: list[int] = []
    weights = 0
    for op in range(warmup + fwd_bwd + warmup):
        if op < warmup + fwd_bwd:
            stage = forward_stage(op)
            ops.append(Action(stage, FORWARD, next_mb(FORWARD, stage)))
            if op < warmup:
                continue
        stage = backward_stage(op)
        ops.append(Action(stage, backward, next_mb(backward, stage)))
        backward_ops.append(op)
        # Zero bubble defers rank r's weight gradients by r microbatches (torch's
        # num_1f1b_microbatches), then runs one after each input gradient.
        if zero_bubble and op - warmup >= rank:
            stage = backward_stage(backward_ops[weights])
            ops.append(Action(stage, BACKWARD_WEIGHT, next_mb(BACKWARD_WEIGHT, stage)))
            weights += 1
    while zero_bubble and weights < len(backward_ops):
        stage = backward_stage(backward_ops[weights])
        ops.append(Action(stage, BACKWARD_WEIGHT, next_mb(BACKWARD_WEIGHT, stage)))
        weights += 1
    return ops


def _zbv(rank: int, p: int, m: int) -> list[Action]:
    """torch's ``ScheduleZBVZeroBubble`` (arXiv:2401.10241 §6): planned for at least 2p - 1
    microbatches, then the actions of microbatches past ``m`` dropped, as torch does."""
    n = max(2 * p - 1, m)
    first, second = rank, 2 * p - 1 - rank
    ops: list[Action] = []
    f0 = f1 = b0 = b1 = 0
    for _ in range(2 * (p - rank) - 1):
        ops.append(Action(first, FORWARD, f0))
        f0 += 1
    for _ in range(rank):
        ops += [Action(second, FORWARD, f1), Action(first, FORWARD, f0)]
        f1 += 1
        f0 += 1
    for _ in range(p - rank):
        ops += [Action(second, FORWARD, f1), Action(second, BACKWARD_INPUT, b1)]
        ops.append(Action(second, BACKWARD_WEIGHT, b1))
        f1 += 1
        b1 += 1
    while f1 < f0 or f0 < n:
        if f0 < n:
            ops.append(Action(first, FORWARD, f0))
            f0 += 1
        ops += [Action(first, BACKWARD_INPUT, b0), Action(first, BACKWARD_WEIGHT, b0)]
        b0 += 1
        ops += [Action(second, FORWARD, f1), Action(second, BACKWARD_INPUT, b1)]
        ops.append(Action(second, BACKWARD_WEIGHT, b1))
        f1 += 1
        b1 += 1
    w0, w1 = b0, b1
    for _ in range(rank):
        ops += [Action(first, BACKWARD_INPUT, b0), Action(second, BACKWARD_INPUT, b1)]
        b0 += 1
        b1 += 1
    for _ in range(p - rank):
        ops += [Action(first, BACKWARD_INPUT, b0), Action(first, BACKWARD_WEIGHT, w0)]
        b0 += 1
        w0 += 1
    ops += [Action(second, BACKWARD_WEIGHT, w) for w in range(w1, b1)]
    ops += [Action(first, BACKWARD_WEIGHT, w) for w in range(w0, b0)]
    return [a for a in ops if a.microbatch is not None and a.microbatch < m]


def _dualpipe_v(rank: int, p: int, m: int) -> list[Action]:
    """torch's ``ScheduleDualPipeV`` (DeepSeek-V3, arXiv:2412.19437): DualPipe folded into a
    V over p ranks; its steady state overlaps one chunk's forward with another's backward."""
    first, second = rank, 2 * p - 1 - rank
    counts: dict[tuple[int, str], int] = {}
    weights: list[tuple[int, int]] = []  # input gradients whose weight gradient is pending
    ops: list[Action] = []

    def take(stage: int, kind: str) -> int:
        # A full backward counts as both halves: torch keys it by its input-gradient counter.
        key = (stage, BACKWARD_INPUT if kind == FULL_BACKWARD else kind)
        mb = counts.get(key, 0)
        counts[key] = mb + 1
        if kind == FULL_BACKWARD:
            counts[stage, BACKWARD_WEIGHT] = counts.get((stage, BACKWARD_WEIGHT), 0) + 1
        return mb

    def add(stage: int, kind: str) -> None:
        mb = take(stage, kind)
        if kind == BACKWARD_INPUT:
            weights.append((stage, mb))
        ops.append(Action(stage, kind, mb))

    def overlap(forward_stage: int, backward_stage: int) -> None:
        f = Action(forward_stage, FORWARD, take(forward_stage, FORWARD))
        b = Action(backward_stage, FULL_BACKWARD, take(backward_stage, FULL_BACKWARD))
        ops.append(Action(-1, OVERLAP_F_B, None, (f, b)))

    def weight() -> None:
        if weights:
            stage, mb = weights.pop(0)
            ops.append(Action(stage, BACKWARD_WEIGHT, mb))

    for _ in range(2 * (p - rank - 1)):
        add(first, FORWARD)
    for _ in range(rank + 1):
        add(first, FORWARD)
        add(second, FORWARD)
    for _ in range(p - rank - 1):
        add(second, BACKWARD_INPUT)
        weight()
        add(second, FORWARD)
    for i in range(m - 2 * p + rank + 1):
        if i == 0 and rank == p - 1:
            add(first, FORWARD)  # the last rank does not overlap its first pair (torch's note)
            add(second, FULL_BACKWARD)
        else:
            overlap(first, second)
        overlap(second, first)
    for _ in range(p - rank - 1):
        add(second, FULL_BACKWARD)
        overlap(second, first)
    # The second half of the last backwards splits off its weight gradients (zero bubble).
    split = False
    for i in range(rank + 1):
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        add(second, BACKWARD_INPUT if split else FULL_BACKWARD)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        add(first, BACKWARD_INPUT if split else FULL_BACKWARD)
    for _ in range(p - rank - 1):
        weight()
        add(first, BACKWARD_INPUT if split else FULL_BACKWARD)
    for _ in range(rank + 1):
        weight()
    return ops


# ---- lowering: torch's passes over a compute-only order ----------------------------------


def add_unshard_reshard(ops: Sequence[Action], max_active_stages: int = 3) -> list[Action]:
    """ZeRO-3 points: torch's ``_add_unshard_reshard``. Before each compute, unshard the next
    ``max_active_stages`` distinct stages this rank computes (prefetch) and reshard the
    active ones not among them; reshard what is left at the end."""
    # A set, as torch's: which of several stages is resharded first follows CPython's
    # iteration order of a set of ints, which is deterministic, and torch's order is the goal.
    active: set[int] = set()
    out: list[Action] = []
    for action, upcoming in zip(ops, _next_stages(ops, max_active_stages), strict=True):
        fetch = [s for s in upcoming if s not in active]
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            out.append(Action(stage, RESHARD))
        for stage in fetch:
            active.add(stage)
            out.append(Action(stage, UNSHARD))
        out.append(action)
    out += [Action(stage, RESHARD) for stage in list(active)]
    return out


def _next_stages(ops: Sequence[Action], count: int) -> list[list[int]]:
    """For each position, the distinct stages computed from there on, in order of first
    appearance, through the action that brings them to ``count`` (torch's
    ``next_stage_indices``: an overlapped pair may bring one more). Built from the end, so
    the walk is linear even where a rank has fewer than ``count`` stages."""
    out: list[list[int]] = [[] for _ in ops]
    firsts: list[tuple[int, int]] = []  # (stage, where it first appears from here on)
    for i in range(len(ops) - 1, -1, -1):
        here = list(dict.fromkeys(leaf.stage for leaf in ops[i].leaves))
        firsts = [(s, i) for s in here] + [(s, j) for s, j in firsts if s not in here]
        cut = firsts[count - 1][1] if len(firsts) >= count else len(ops)
        out[i] = [s for s, j in firsts if j <= cut]
    return out


def add_reduce_grad(ops: Sequence[Action], microbatches: int) -> list[Action]:
    """A ``REDUCE_GRAD`` right after each stage's last full or weight backward: torch's
    ``_add_reduce_grad``; the stage's gradients are final there, so data parallelism reduces
    them while the pipeline drains."""
    done: dict[int, int] = {}
    out: list[Action] = []
    for action in ops:
        out.append(action)
        for leaf in action.leaves:
            if leaf.kind in (FULL_BACKWARD, BACKWARD_WEIGHT):
                done[leaf.stage] = done.get(leaf.stage, 0) + 1
                if done[leaf.stage] == microbatches:
                    out.append(Action(leaf.stage, REDUCE_GRAD))
    return out


def add_send_recv(
    orders: Sequence[Sequence[Action]], ranks: Sequence[int], num_stages: int
) -> Orders:
    """The sends and receives: torch's ``_add_send_recv``. Ranks take turns, each scheduling its
    next action once its input is local or received; a send is written right after the compute
    that produced it and its receive at that moment on the peer, so each pair of ranks posts
    its sends and receives in the same order.

    Raises:
        ValueError: when no rank can take its next action (a malformed order).
    """

    def comms(leaf: Action) -> tuple[Action, Action] | None:
        s = leaf.stage
        if leaf.kind == FORWARD and s != num_stages - 1 and ranks[s + 1] != ranks[s]:
            return Action(s, SEND_F, leaf.microbatch), Action(s + 1, RECV_F, leaf.microbatch)
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT) and s != 0 and ranks[s - 1] != ranks[s]:
            return Action(s, SEND_B, leaf.microbatch), Action(s - 1, RECV_B, leaf.microbatch)
        return None

    def ready(leaf: Action, seen: set[Action]) -> bool:
        s, mb = leaf.stage, leaf.microbatch
        if leaf.kind == FORWARD and s != 0:
            return Action(s, RECV_F, mb) in seen or Action(s - 1, FORWARD, mb) in seen
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT) and s != num_stages - 1:
            return (
                Action(s, RECV_B, mb) in seen
                or Action(s + 1, BACKWARD_INPUT, mb) in seen
                or Action(s + 1, FULL_BACKWARD, mb) in seen
            )
        return True

    pending = {rank: list(ops) for rank, ops in enumerate(orders) if ops}
    out: Orders = [[] for _ in orders]
    seen: list[set[Action]] = [set() for _ in orders]
    while pending:
        progress = False
        for rank in sorted(pending):
            action = pending[rank][0]
            if not all(ready(leaf, seen[rank]) for leaf in action.leaves):
                continue
            out[rank].append(action)
            for leaf in action.leaves:
                seen[rank].add(leaf)
                pair = comms(leaf)
                if pair is not None:
                    send, recv = pair
                    out[rank].append(send)
                    seen[rank].add(send)
                    out[ranks[recv.stage]].append(recv)
                    seen[ranks[recv.stage]].add(recv)
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            stuck = ", ".join(f"rank {r} at {pending[r][0]}" for r in sorted(pending))
            raise ValueError(
                f"the compute order cannot be lowered to sends and receives: no rank can take "
                f"its next action ({stuck}); each forward needs the previous stage's forward "
                "and each backward the next stage's backward earlier in the order"
            )
    return out


def lower(
    orders: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    microbatches: int,
    *,
    zero3: bool,
) -> Orders:
    """A compute-only order lowered as torch's ``_prepare_schedule_with_comms`` lowers it."""
    lowered = [add_unshard_reshard(ops) if zero3 else list(ops) for ops in orders]
    lowered = [add_reduce_grad(ops, microbatches) for ops in lowered]
    return add_send_recv(lowered, ranks, len(ranks))
