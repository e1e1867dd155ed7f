"""``gradsync plan --pp P``: a pipeline plan, its timeline, bubble and peak stash.

``--microbatches M --schedule NAME``; the timeline rank by rank and tick by tick, the peak stash
per rank (docs/pipeline.md).

The timeline is the simulator's with unit ticks: a forward takes 1, a full backward 2 (its
input and weight halves 1 each), a point-to-point message 0. Bounded so a typo cannot plan for
minutes: at most ``MAX_PIPELINE_RANKS`` pipeline ranks and ``MAX_STAGE_MICROBATCHES`` stage
microbatches (pp x stages per rank x microbatches).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence

from gradsync_core.cli._json import report_header
from gradsync_core.cli._table import table
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.pipeline._plan import PipelinePlan, plan_pipeline
from gradsync_core.plan.pipeline._schedules import SCHEDULES, default_stages_per_rank, schedule_name
from gradsync_core.plan.pipeline._sim import PipelineSimulation, simulate_pipeline

MAX_PIPELINE_RANKS = 1024
MAX_STAGE_MICROBATCHES = 1 << 16
# The chart's ticks: torch's schedules are drawn with these (a backward is twice a forward).
TICKS = {"forward": 1, "backward": 2, "weight": 1}
_RULER_EVERY = 10


def add_pipeline_arguments(plan: argparse.ArgumentParser) -> None:
    """The pipeline options of ``gradsync plan``."""
    plan.add_argument(
        "--schedule",
        default=None,
        metavar="NAME",
        help=f"plan a pipeline with this schedule ({', '.join(SCHEDULES)}; torch's names, any "
        "case; ZB1P, ZBV too) over --pp ranks and print its timeline",
    )
    plan.add_argument(
        "--microbatches",
        type=int,
        default=None,
        metavar="M",
        help="--schedule: microbatches per step",
    )
    plan.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        metavar="V",
        help="--schedule: virtual stages per rank (default 2 for the multi-stage schedules, 1 "
        "for GPipe and 1F1B); --zero 3 plans UNSHARD/RESHARD",
    )


def pipeline_requested(args: argparse.Namespace) -> bool:
    """Whether any pipeline option was given (then ``--schedule`` and ``--microbatches``
    both must be)."""
    return any(x is not None for x in (args.schedule, args.microbatches, args.stages_per_rank))


def pipeline_command(args: argparse.Namespace, specs: Sequence[ParamSpec], topo: Topology) -> int:
    """Print the pipeline plan of ``specs`` over ``topo``'s pp groups (or its JSON)."""
    if args.schedule is None or args.microbatches is None:
        raise ValueError("a pipeline plan needs both --schedule NAME and --microbatches M")
    v = args.stages_per_rank
    for name, value in (("microbatches", args.microbatches), ("stages-per-rank", v)):
        if value is not None and value < 1:
            raise ValueError(f"--{name} must be a positive int, got {value}")
    if topo.pp > MAX_PIPELINE_RANKS:
        raise ValueError(f"--pp must be at most {MAX_PIPELINE_RANKS:,} with --schedule")
    work = (
        topo.pp * (v or default_stages_per_rank(schedule_name(args.schedule))) * args.microbatches
    )
    if work > MAX_STAGE_MICROBATCHES:
        raise ValueError(
            f"pp x stages per rank x microbatches = {work:,} is more than "
            f"{MAX_STAGE_MICROBATCHES:,}; plan fewer microbatches"
        )
    plan = plan_pipeline(
        schedule=args.schedule,
        microbatches=args.microbatches,
        topology=topo,
        specs=specs,
        stages_per_rank=v,
        zero3=args.zero == 3,
    )
    sim = simulate_pipeline(
        plan, forward=TICKS["forward"], backward=TICKS["backward"], weight=TICKS["weight"]
    )
    if args.json:
        out = report_header() | {
            "pipeline": plan.to_json(),
            "simulation": {
                "ticks": TICKS | {"p2p": 0},
                "step_time": sim.step_time,
                "bubble": sim.bubble,
                "idle": list(sim.idle),
                "peak_stash": list(sim.peak_stash),
            },
            "fingerprints": {"pipeline": plan.fingerprint, "topology": topo.fingerprint},
        }
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    print(pipeline_text(plan, sim, args.params or args.model))
    return 0


def pipeline_text(plan: PipelinePlan, sim: PipelineSimulation, source: str) -> str:
    """The stages, the timeline chart, the bubble and the stash, as ``gradsync plan`` prints."""
    topo, v = plan.topology, plan.stages_per_rank
    head = (
        f"Pipeline {plan.schedule} for {source}: pp {plan.pp} x {v} stage"
        f"{'s' if v > 1 else ''} per rank ({plan.placement} placement), "
        f"{plan.microbatches} microbatches; {topo.group_count('pp')} pipeline group"
        f"{'s' if topo.group_count('pp') > 1 else ''} of world size {topo.world_size}"
        + (", parameters sharded (ZeRO-3: UNSHARD/RESHARD planned)" if plan.zero3 else "")
    )
    rows = [[s.index, s.rank, s.layout, _modules(s.modules)] for s in plan.stages]
    stages = f"Stages: layout {plan.layout!r}\n" + table(
        ["stage", "pp rank", "layers", "modules"], rows
    )
    ticks = ", ".join(f"{k} {t}" for k, t in TICKS.items())
    chart = f"Timeline ({ticks} ticks; p2p 0; '.' idle):\n" + chart_text(plan, sim)
    per_rank = table(
        ["pp rank", "idle ticks", "peak stash (microbatches)"],
        [[r, _number(sim.idle[r]), sim.peak_stash[r]] for r in range(plan.pp)],
    )
    bubble = (
        f"Step {_number(sim.step_time)} ticks; bubble {100 * sim.bubble:.1f}% "
        "(idle / (ranks x step))\n" + per_rank
    )
    prints = f"fingerprints: pipeline {plan.fingerprint[:16]}  topology {topo.fingerprint[:16]}"
    return "\n\n".join([head, stages, chart, bubble, prints])


def chart_text(plan: PipelinePlan, sim: PipelineSimulation) -> str:
    """Rank by rank, tick by tick: each compute action's label over the ticks it runs
    (``F3`` forward of microbatch 3; with several stages per rank, ``4F3`` for stage 4)."""
    width = int(sim.step_time)
    label_of = (lambda a: f"{a.kind}{a.microbatch}") if plan.stages_per_rank == 1 else str
    cells = [["."] * width for _ in range(plan.pp)]
    for rank, timed in enumerate(sim.actions):
        for t in timed:
            for tick in range(int(t.start), int(t.end)):
                cells[rank][tick] = label_of(t.action)
    size = max((len(c) for row in cells for c in row), default=1)
    ruler = "".join(
        str(tick).ljust((size + 1) * _RULER_EVERY) for tick in range(0, width, _RULER_EVERY)
    ).rstrip()
    prefix = len(f"rank {plan.pp - 1}") + 2
    lines = [" " * prefix + ruler]
    for rank, row in enumerate(cells):
        lines.append(f"rank {rank}".ljust(prefix) + " ".join(c.ljust(size) for c in row).rstrip())
    return "\n".join(lines)


def _modules(names: Sequence[str], limit: int = 4) -> str:
    if len(names) <= limit:
        return ", ".join(names)
    return ", ".join(names[: limit - 1]) + f", ... {names[-1]} ({len(names)})"


def _number(x: float) -> str:
    return str(int(x)) if x == int(x) else f"{x:g}"
