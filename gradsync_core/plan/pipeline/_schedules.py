"""The schedules: each rank's compute order and each stage's rank (docs/pipeline.md).

Every schedule torch 2.13 ships, computed as torch computes it so the per-rank order is
torch's, action for action: for the runtime schedules (looped BFS, interleaved 1F1B,
interleaved zero bubble, ZBV, DualPipeV) ``_calculate_single_rank_operations``; for GPipe and
1F1B what ``_step_microbatches`` runs (their ``_get_pipeline_order`` only illustrates). Where
torch refuses a combination this refuses it too, with a sentence. ``_lower`` then
adds the communication and the data-parallel and ZeRO-3 points.
"""

from __future__ import annotations

from gradsync_core.plan.pipeline._actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
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
