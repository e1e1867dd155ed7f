"""A pipeline plan as one global tick grid, with every buffer slot assigned (docs/pipeline.md).

In one SPMD program every device runs the same loop; at tick t pipeline rank r runs up to three
cells of its stage work, one per **lane**: a forward in the forward lane, a full backward
(``B``: input then weight gradient, one cell) or an input gradient (``I``) in the backward
lane, and a weight gradient (``W``) in the weight lane, where the plan splits the backward
(zero bubble). At the end of every tick each lane's output (the forward's activations, the
input gradient) moves one hop with ``ppermute``. The grid is each rank's plan order run as
soon as it can (``tick_grid``): a rank takes its next cell at the first tick where the values
it reads are there, and the cells after it in the same tick while each is of a lane still
free and ready too (1F1B's steady state: a forward and a backward per tick; ZB1P's: a forward,
an input and a weight gradient, so it runs in as many ticks as 1F1B). A tick makes at most
one weight gradient (a ``B`` and a ``W`` never share one). A value made at tick t is on its
consumer at tick t + 1, so every read finds its data.

The values a cell leaves for a later one wait in fixed-size buffers, a slot each, held from
the tick after the write through the last read: the stage inputs that have arrived (``act``),
the output gradients that have arrived (``grad``), what a microbatch's forward keeps for its
backward (``stash``: from the forward to the weight gradient, so a rank needs at most the
plan's peak stash of slots) and what a split input gradient leaves its weight gradient
(``cross``: from the input gradient's tick, since in a tick the weight lane reads after the
backward lane wrote). A tick receives after its cells read, so an ``act`` or ``grad`` slot
read for the last time at t takes a new value at t. Slots are assigned per rank by interval
colouring (optimal for intervals), and a buffer has the most slots any rank needs, plus one
spare slot that the ticks which keep nothing write to (a write to a computed slot keeps
XLA's update in place; a masked write would read the slot back and copy the whole buffer
every tick).

A stage adds its microbatches' weight gradients in microbatch order under every schedule
(docs/design.md §17), as the torch executor does. Where a schedule runs them out of order
(looped BFS: last microbatch first), a gradient that comes early waits in the ``held``
buffer until every one before it is in; each rank adds at most one gradient per tick, and
what is left when the ticks end is added after the loop (``TickProgram.drain``), in order.
Everything here is plain Python and NumPy: the tables are static data that the step indexes
with ``lax.axis_index("pp")``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from gradsync_core import PipelinePlan

IDLE, FORWARD, INPUT, WEIGHT, BACKWARD = 0, 1, 2, 3, 4  # the cell kinds
KIND_NAMES = {FORWARD: "F", INPUT: "I", WEIGHT: "W", BACKWARD: "B"}
GRADIENT_KINDS = (WEIGHT, BACKWARD)  # the cells that make weight gradients
LANES = ("f", "b", "w")  # the forward lane, the backward lane (I or B), the weight lane (W)
BUFFERS = ("act", "grad", "stash", "cross", "held")
SOURCES = ("left", "right", "local")  # from rank r-1, from rank r+1, this rank's own output

# Columns of the per-tick table. A read of "none" reads slot 0 and ignores it; a write of
# "none" goes to the buffer's spare last slot (``TickProgram.slots[buf]``).
COLUMNS = (
    *(f"{lane}_{name}" for lane in LANES for name in ("branch", "kind", "local", "mb")),
    # ``{lane}_branch``: 0 idle, else 1 + the index of (kind, stage type) in
    # ``TickProgram.branches``; ``{lane}_local``: the stage's place among this rank's stages
    "act_read",  # forward: the slot of its input
    "stash_write",  # forward
    "grad_read",  # input gradient or backward: its output gradient's slot (none: the seed)
    "stash_read",  # input gradient or backward
    "w_stash_read",  # weight gradient
    "cross_read",  # weight gradient
    "cross_write",  # input gradient
    "held_write",  # the tick's weight gradient or backward: where its gradients wait
    "held_read",  # the held gradient added at this tick (none: the spare slot, all zeros)
    "held_local",  # the local stage it is added to
    *(f"{buf}_from_{src}" for buf in ("act", "grad") for src in SOURCES),
)
COL = {name: i for i, name in enumerate(COLUMNS)}

FIRST, MIDDLE, LAST, ONLY = "first", "middle", "last", "only"  # stage types


def stage_type(stage: int, num_stages: int) -> str:
    """``"first"`` holds the embedding, ``"last"`` the head and loss, ``"only"`` both."""
    if num_stages == 1:
        return ONLY
    return FIRST if stage == 0 else LAST if stage == num_stages - 1 else MIDDLE


@dataclass(frozen=True, slots=True, kw_only=True)
class Cell:
    """What one rank computes in one lane of one tick."""

    kind: int
    stage: int
    microbatch: int

    @property
    def lane(self) -> int:
        """0: the forward lane, 1: the backward lane (I or B), 2: the weight lane (W)."""
        return 0 if self.kind == FORWARD else 2 if self.kind == WEIGHT else 1


Tick = tuple[Cell | None, ...]  # one rank's cells at one tick, by lane (len(LANES))
WORK = {FORWARD: 1, INPUT: 1, WEIGHT: 1, BACKWARD: 2}  # a cell's cost in forwards


@dataclass(frozen=True, slots=True, kw_only=True)
class TickProgram:
    """A plan compiled for one SPMD loop: ``table[t, r]`` is rank r's row at tick t.

    ``branches`` lists the (kind, stage type) pairs that occur (the switches' branches);
    ``slots`` the slot count of each buffer, its spare slot not counted (the step allocates
    ``slots + 1``); ``sources`` which (buffer, source) receives ever happen, so the step
    writes only those; ``peak`` each rank's most stashed microbatches (forward done, weight
    gradient not yet, counted at the end of each tick): ``slots["stash"]`` is their maximum.
    ``slots["held"]`` is 0 where every weight gradient runs in microbatch order (added as it
    is made: no ``held`` buffer); otherwise every weight gradient goes through it, and
    ``drain[j, r]`` is the ``(held slot, local stage)`` rank r adds in the j-th step after
    the loop (the spare slot, all zeros, once it has nothing left). ``phases`` cuts the ticks
    where the kinds of cell that run change (``tick_phases``): the step runs one loop per
    phase. ``busy`` is each rank's work and ``length`` each tick's (its heaviest rank's), in
    forwards (``WORK``).
    """

    pp: int
    num_stages: int
    microbatches: int
    ticks: int
    table: np.ndarray  # (ticks, pp, len(COLUMNS)) int32
    branches: tuple[tuple[int, str], ...]
    slots: dict[str, int]
    sources: tuple[tuple[str, str], ...]
    stage_types: tuple[str, ...]
    local_index: tuple[int, ...]  # per stage: its place among its rank's stages
    peak: tuple[int, ...]
    busy: tuple[int, ...]  # work per rank, in forwards
    length: tuple[int, ...]  # work per tick: its heaviest rank's
    drain: np.ndarray  # (steps after the loop, pp, 2) int32: held slot, local stage
    phases: tuple[tuple[int, int], ...]  # (first tick, end tick): ``tick_phases``

    @property
    def bubble(self) -> float:
        """Idle work over all work in lockstep (every tick as long as its heaviest rank)."""
        return 1.0 - sum(self.busy) / (self.pp * sum(self.length))

    def kinds(self, lane: int) -> np.ndarray:
        """``(ticks, pp)``: the kind of each rank's cell in ``lane`` at each tick (0 idle)."""
        return self.table[:, :, COL[f"{LANES[lane]}_kind"]]


def tick_grid(plan: PipelinePlan) -> list[list[Tick]]:
    """Each rank's cells at each tick, by lane: every rank runs its plan order, each cell at
    the first tick where what it reads is there (made at an earlier tick), and the next
    cells in the same tick too while each is of a lane still free and ready (and is not a
    ``B`` beside a ``W``: a tick makes at most one weight gradient).

    A plan's ``B`` is one cell (its input and weight gradient together, one program), its
    ``I`` and ``W`` two; an ``OVERLAP_F_B`` is its forward and its backward. A ``zero3``
    plan's ``UNSHARD`` and ``RESHARD`` are no cells: the step gathers a rank's stages before
    the loop and reduce-scatters their gradients after it (``sharded.py``).
    """
    kinds = {"F": FORWARD, "I": INPUT, "W": WEIGHT, "B": BACKWARD}
    orders = [
        [
            Cell(kind=kinds[leaf.kind], stage=leaf.stage, microbatch=leaf.microbatch)
            for action in plan.actions[rank]
            if action.is_compute
            for leaf in action.leaves
            if leaf.microbatch is not None
        ]
        for rank in range(plan.pp)
    ]
    last = plan.num_stages - 1
    made: dict[tuple[str, int, int], int] = {}  # ("f" | "dx" | "i", stage, mb) -> tick

    def reads(cell: Cell) -> list[tuple[str, int, int]]:
        s, mb = cell.stage, cell.microbatch
        if cell.kind == FORWARD:
            return [("f", s - 1, mb)] if s > 0 else []
        if cell.kind == WEIGHT:
            return [("i", s, mb)]
        return [("f", s, mb)] + ([("dx", s + 1, mb)] if s < last else [])

    def ready(cell: Cell, t: int) -> bool:
        return all(made.get(key, t) < t for key in reads(cell))

    grid: list[list[Tick]] = [[] for _ in range(plan.pp)]
    place = [0] * plan.pp
    limit = 2 * sum(map(len, orders)) + plan.pp + 1
    t = 0
    while any(place[r] < len(orders[r]) for r in range(plan.pp)):
        if t >= limit:
            raise AssertionError("the plan's orders wait on each other")  # check_actions
        ran = []
        for rank, order in enumerate(orders):
            lanes: list[Cell | None] = [None] * len(LANES)
            while place[rank] < len(order):
                cell = order[place[rank]]
                if lanes[cell.lane] is not None or not ready(cell, t):
                    break
                if cell.kind in GRADIENT_KINDS and _grads_cell(lanes) is not None:
                    break  # a tick makes at most one weight gradient
                lanes[cell.lane] = cell
                place[rank] += 1
            grid[rank].append(tuple(lanes))
            ran += [c for c in lanes if c is not None]
        for cell in ran:
            s, mb = cell.stage, cell.microbatch
            if cell.kind == FORWARD:
                made["f", s, mb] = t
            if cell.kind in (INPUT, BACKWARD):
                made["dx", s, mb] = t
            if cell.kind == INPUT:
                made["i", s, mb] = t
        t += 1
    return grid


def tick_phases(grid: Sequence[Sequence[Tick]]) -> tuple[tuple[int, int], ...]:
    """The ticks cut in at most three phases, ``(first tick, end tick)`` each: the warm-up
    before any rank's first backward- or weight-lane cell (forwards only), the ticks up to
    the last forward, and the cool-down after it (no forward). The step runs each as
    its own loop, whose body holds only what its cells make: no forward's stash in the
    cool-down, no gradient in the warm-up (GPipe's phases are its forwards, the one tick
    where its last rank runs its last forward and first backward, and its backwards)."""
    ticks = len(grid[0])
    lanes = [{lane for row in grid for lane, c in enumerate(row[t]) if c} for t in range(ticks)]
    first_back = next((t for t, used in enumerate(lanes) if used - {0}), ticks)
    last_forward = max((t for t, used in enumerate(lanes) if 0 in used), default=-1)
    cuts = sorted({0, first_back, max(first_back, last_forward + 1), ticks})
    return tuple((a, b) for a, b in itertools.pairwise(cuts) if a < b)


def compile_ticks(plan: PipelinePlan) -> TickProgram:
    """The plan as per-tick tables with every buffer slot assigned (module docstring)."""
    grid = tick_grid(plan)
    pp, n, m = plan.pp, plan.num_stages, plan.microbatches
    ticks = len(grid[0])
    ranks = plan.stage_ranks
    local = [plan.stages_of(ranks[s]).index(plan.stages[s]) for s in range(n)]
    types = tuple(stage_type(s, n) for s in range(n))
    when: dict[tuple[int, int, int], tuple[int, int]] = {}  # (kind, stage, mb) -> (tick, rank)
    for rank in range(pp):
        for t, cells in enumerate(grid[rank]):
            for cell in cells:
                if cell is not None:
                    when[cell.kind, cell.stage, cell.microbatch] = (t, rank)

    def backward(s: int, mb: int) -> tuple[int, int]:
        """When the (stage, microbatch)'s input gradient and weight gradient run."""
        if (BACKWARD, s, mb) in when:
            t = when[BACKWARD, s, mb][0]
            return t, t
        return when[INPUT, s, mb][0], when[WEIGHT, s, mb][0]

    # Every value that waits: (buffer, rank, first tick held, read tick, key), plus where a
    # received one comes from. Keys: (stage, microbatch, 0).
    intervals: list[tuple[str, int, int, int, tuple[int, int, int]]] = []
    arrivals: list[tuple[str, int, int, str, tuple[int, int, int]]] = []
    for s in range(n):
        for mb in range(m):
            tf, rank = when[FORWARD, s, mb]
            ti, tw = backward(s, mb)
            assert tf < ti <= tw, (s, mb)
            # from its write: the slot of a stash that a backward reads for the last time at
            # the forward's tick is not this one's (the forward writes first)
            intervals.append(("stash", rank, tf, tw, (s, mb, 0)))
            if ti < tw:  # from the write: in a tick the weight lane reads after it
                intervals.append(("cross", rank, ti, tw, (s, mb, 0)))
            if s > 0:  # the previous stage's output, written at the end of its tick
                tp, src_rank = when[FORWARD, s - 1, mb]
                intervals.append(("act", rank, tp + 1, tf, (s, mb, 0)))
                arrivals.append(("act", tp, rank, _source(src_rank, rank, pp), (s, mb, 0)))
            if s < n - 1:  # the next stage's input gradient
                tn, _ = backward(s + 1, mb)
                src_rank = ranks[s + 1]
                intervals.append(("grad", rank, tn + 1, ti, (s, mb, 0)))
                arrivals.append(("grad", tn, rank, _source(src_rank, rank, pp), (s, mb, 0)))
    adds = {
        rank: _microbatch_order([_grads_cell(cells) for cells in grid[rank]]) for rank in range(pp)
    }
    if any(t != backward(s, mb)[1] for added in adds.values() for t, s, mb in added):
        for rank, added in adds.items():
            for t, s, mb in added:
                intervals.append(("held", rank, backward(s, mb)[1], t, (s, mb, 0)))
    slot_of: dict[tuple[str, tuple[int, int, int]], int] = {}
    slots = {}
    for buf in BUFFERS:
        most = 0
        for rank in range(pp):
            mine = [(a, b, key) for name, r, a, b, key in intervals if name == buf and r == rank]
            for key, slot in _colour(mine).items():
                slot_of[buf, key] = slot
                most = max(most, slot + 1)
        slots[buf] = most

    branches = sorted(
        {(c.kind, types[c.stage]) for row in grid for cells in row for c in cells if c}
    )
    branch_of = {b: i + 1 for i, b in enumerate(branches)}
    table = np.zeros((ticks, pp, len(COLUMNS)), dtype=np.int32)
    for name in COLUMNS:  # writes of "none" go to the spare slot
        if name.endswith("_write") or "_from_" in name:
            table[:, :, COL[name]] = slots[name.split("_")[0]]
    table[:, :, COL["held_read"]] = slots["held"]  # the spare slot: zeros, nothing added
    after = max((t - ticks + 1 for added in adds.values() for t, _, _ in added), default=0)
    drain = np.zeros((max(after, 0) if slots["held"] else 0, pp, 2), dtype=np.int32)
    drain[:, :, 0] = slots["held"]
    if slots["held"]:
        for rank, added in adds.items():
            for t, s, mb in added:
                slot = slot_of["held", (s, mb, 0)]
                if t < ticks:
                    table[t, rank, COL["held_read"]] = slot
                    table[t, rank, COL["held_local"]] = local[s]
                else:
                    drain[t - ticks, rank] = (slot, local[s])
    for rank in range(pp):
        for t, cells in enumerate(grid[rank]):
            for cell in cells:
                if cell is None:
                    continue
                s, mb, kind = cell.stage, cell.microbatch, cell.kind
                row = table[t, rank]
                lane = LANES[cell.lane]
                row[COL[f"{lane}_branch"]] = branch_of[kind, types[s]]
                row[COL[f"{lane}_kind"]] = kind
                row[COL[f"{lane}_local"]] = local[s]
                row[COL[f"{lane}_mb"]] = mb
                if kind == FORWARD:
                    row[COL["act_read"]] = slot_of.get(("act", (s, mb, 0)), 0)
                    row[COL["stash_write"]] = slot_of["stash", (s, mb, 0)]
                    continue
                read = "w_stash_read" if kind == WEIGHT else "stash_read"
                row[COL[read]] = slot_of["stash", (s, mb, 0)]
                if kind in (INPUT, BACKWARD):
                    row[COL["grad_read"]] = slot_of.get(("grad", (s, mb, 0)), 0)
                if kind == INPUT:
                    row[COL["cross_write"]] = slot_of["cross", (s, mb, 0)]
                if kind == WEIGHT:
                    row[COL["cross_read"]] = slot_of["cross", (s, mb, 0)]
                if kind in GRADIENT_KINDS and slots["held"]:
                    row[COL["held_write"]] = slot_of["held", (s, mb, 0)]
    sources = set()
    for buf, t, rank, src, key in arrivals:
        table[t, rank, COL[f"{buf}_from_{src}"]] = slot_of[buf, key]
        sources.add((buf, src))
    peak = []
    for rank in range(pp):
        held = np.zeros(ticks + 1, dtype=np.int64)
        for s in range(n):
            if ranks[s] == rank:
                for mb in range(m):
                    held[when[FORWARD, s, mb][0] : backward(s, mb)[1] + 1] += 1
        peak.append(int(held.max()))
    work = [[sum(WORK[c.kind] for c in cells if c) for cells in row] for row in grid]
    return TickProgram(
        pp=pp,
        num_stages=n,
        microbatches=m,
        ticks=ticks,
        table=table,
        branches=tuple(branches),
        slots=slots,
        sources=tuple(sorted(sources)),
        stage_types=types,
        local_index=tuple(local),
        peak=tuple(peak),
        busy=tuple(sum(row) for row in work),
        length=tuple(max(col) for col in zip(*work, strict=True)),
        drain=drain,
        phases=tick_phases(grid),
    )


def _grads_cell(cells: Sequence[Cell | None]) -> Cell | None:
    """The tick's cell that makes weight gradients (a ``W`` or a ``B``), if any."""
    return next((c for c in cells if c is not None and c.kind in GRADIENT_KINDS), None)


def _microbatch_order(cells: Sequence[Cell | None]) -> list[tuple[int, int, int]]:
    """When one rank adds each weight gradient, ``(tick, stage, microbatch)``: every stage's
    in microbatch order, at most one per tick, none before it is made; a gradient made in
    order is added at once, one that comes early waits, and what still waits when the ticks
    end is added at ticks ``len(cells)``, ``len(cells) + 1``, ... (after the loop)."""
    following: dict[int, int] = {}  # stage -> the microbatch it adds next
    waiting: dict[tuple[int, int], int] = {}  # (stage, microbatch) -> the tick it was made
    out = []

    def add_waiting(t: int) -> bool:
        ready = [key for key in waiting if following.get(key[0], 0) == key[1]]
        if not ready:
            return False
        s, mb = min(ready, key=lambda key: (waiting[key], key))
        del waiting[s, mb]
        following[s] = mb + 1
        out.append((t, s, mb))
        return True

    for t, cell in enumerate(cells):
        if cell is not None and cell.kind in GRADIENT_KINDS:
            s, mb = cell.stage, cell.microbatch
            if following.get(s, 0) == mb:
                following[s] = mb + 1
                out.append((t, s, mb))
                continue
            waiting[s, mb] = t
        add_waiting(t)
    t = len(cells)
    while waiting:
        assert add_waiting(t), waiting  # every microbatch's weight gradient runs once
        t += 1
    return out


def _source(src: int, dst: int, pp: int) -> str:
    """Which shift brings rank ``src``'s output to rank ``dst`` (neighbours on the ring)."""
    if src == dst:
        return "local"
    if dst == (src + 1) % pp:
        return "left"  # it comes from the left neighbour: the shift to the right
    if dst == (src - 1) % pp:
        return "right"
    raise ValueError(
        f"stage data moves from pipeline rank {src} to rank {dst}, which are not neighbours; "
        "the JAX executor moves data one hop per tick (loop or V placement)"
    )


def _colour(
    intervals: Sequence[tuple[int, int, tuple[int, int, int]]],
) -> dict[tuple[int, int, int], int]:
    """Slots for closed intervals [a, b]: by start, each takes the lowest free slot."""
    free_at: list[int] = []  # per slot: the first tick it is free again
    out = {}
    for a, b, key in sorted(intervals, key=lambda x: (x[0], x[1], x[2])):
        for slot, free in enumerate(free_at):
            if free <= a:
                free_at[slot] = b + 1
                out[key] = slot
                break
        else:
            free_at.append(b + 1)
            out[key] = len(free_at) - 1
    return out
