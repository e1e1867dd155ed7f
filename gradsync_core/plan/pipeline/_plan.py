"""The pipeline plan: stages, their ranks and every rank's ordered actions (docs/pipeline.md).

Pipeline parallelism as data, like every gradsync plan: computed once in pure Python from the
model's layers, a ``Topology`` and a schedule name, checked at construction (``check_actions``),
fingerprinted so ranks can agree on it, and executed action by action. The actions are torch's
(``_actions``); the schedules compute the order torch computes
(``_schedules``) and torch's passes add the rest (``_lower``); a plan writes
torch's CSV and reads it back.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology
from gradsync_core.plan.pipeline._actions import FORWARD, RESHARD, UNSHARD, Action
from gradsync_core.plan.pipeline._layout import (
    Partition,
    generic_modules,
    layout_string,
    parse_layout,
    partition_layers,
    partition_specs,
)
from gradsync_core.plan.pipeline._lower import lower
from gradsync_core.plan.pipeline._schedules import (
    compute_orders,
    default_stages_per_rank,
    placement_of,
    schedule_name,
    stage_ranks,
)
from gradsync_core.plan.pipeline._sim import check_actions

CSV_FORMATS = ("compute_only", "compute_comms")  # torch's ``_load_csv``/``_dump_csv`` formats
CUSTOM = "custom"  # the schedule name of a plan read from a CSV


@dataclass(frozen=True, slots=True, kw_only=True)
class Stage:
    """One pipeline stage: where it runs and what it computes.

    ``rank`` is the stage's place in its pipeline group (torch's group rank); ``layout`` its
    layers in Megatron-core's letters (``"Ettt"``; empty when the plan was read from a CSV
    without a layout); ``modules`` the names of what it computes, in order: module prefixes
    when planned from parameter specs (``transformer.h.3``), else ``embedding``, ``layers.i``,
    ``mtp.j``, ``loss`` by position.
    """

    index: int
    rank: int
    layout: str
    modules: tuple[str, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelinePlan:
    """Every pipeline rank's ordered actions for one training step (docs/pipeline.md).

    ``actions[r]`` is what pipeline rank r runs, in order, in torch's grammar: compute
    (``2F0``, ``2B0``, ``2I0``/``2W0``, ``(0F3;3B1)OVERLAP_F_B``), point-to-point
    (``1SEND_F3``, ``2RECV_F3``), ``2REDUCE_GRAD`` where the stage's gradients are final (the
    data-parallel reduction) and, with ``zero3``, ``2UNSHARD``/``2RESHARD`` around its compute.
    Every pipeline group of ``topology`` runs the same plan. Construction checks the actions
    (``check_actions``): a plan that exists can run.

    Example:
        >>> plan = plan_pipeline(schedule="1F1B", microbatches=4, topology=Topology(pp=2),
        ...                      layers=4)
        >>> plan.layout, [str(a) for a in plan.compute_order(1)]
        ('Et*2|t*2L', ['1F0', '1B0', '1F1', '1B1', '1F2', '1B2', '1F3', '1B3'])
    """

    schedule: str
    microbatches: int
    placement: str  # "loop", "v", or "custom" (a CSV's own stage-to-rank map)
    zero3: bool
    topology: Topology
    stages: tuple[Stage, ...]
    actions: tuple[tuple[Action, ...], ...]

    def __post_init__(self) -> None:
        pp = self.topology.pp
        if len(self.actions) != pp:
            raise ValueError(
                f"the plan lists actions for {len(self.actions)} ranks but pp = {pp}; give "
                "one row of actions per pipeline rank"
            )
        if not self.stages or [s.index for s in self.stages] != list(range(len(self.stages))):
            raise ValueError("stages must be listed in order, indexed 0, 1, 2, ...")
        for stage in self.stages:
            if not 0 <= stage.rank < pp:
                raise ValueError(
                    f"stage {stage.index} is placed on pipeline rank {stage.rank}, but pp = {pp} "
                    f"has ranks 0 to {pp - 1}"
                )
        held = [self.stage_ranks.count(rank) for rank in range(pp)]
        if len(set(held)) != 1:
            raise ValueError(
                f"pipeline ranks hold {held} stages; every rank holds the same number of "
                "stages (pp x stages per rank in all)"
            )
        if self.placement != CUSTOM and (
            self.placement not in ("loop", "v")
            or self.num_stages % pp
            or self.stage_ranks != stage_ranks(pp, self.num_stages, self.placement)
        ):
            raise ValueError(
                f"placement {self.placement!r} does not match the stages' ranks "
                f"{self.stage_ranks}; placement is 'loop', 'v' (torch's) or 'custom'"
            )
        if not isinstance(self.microbatches, int) or self.microbatches < 1:
            raise ValueError(f"microbatches must be a positive int, got {self.microbatches!r}")
        check_actions(self.actions, self.stage_ranks, self.microbatches, zero3=self.zero3)

    @property
    def pp(self) -> int:
        return self.topology.pp

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def stages_per_rank(self) -> int:
        return self.num_stages // self.pp

    @property
    def stage_ranks(self) -> tuple[int, ...]:
        """The pipeline rank of each stage."""
        return tuple(stage.rank for stage in self.stages)

    @property
    def layout(self) -> str:
        """The partition as a Megatron-core layout string (``"Et*3|t*3|t*3|tL"``)."""
        return layout_string([stage.layout for stage in self.stages])

    def stages_of(self, pp_rank: int) -> tuple[Stage, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in stage order."""
        return tuple(stage for stage in self.stages if stage.rank == pp_rank)

    def compute_order(self, pp_rank: int) -> tuple[Action, ...]:
        """Pipeline rank ``pp_rank``'s compute actions in order (torch's ``pipeline_order``
        without its idle ``None`` steps)."""
        return tuple(a for a in self.actions[pp_rank] if a.is_compute)

    def actions_for(self, rank: int) -> tuple[Action, ...]:
        """The actions global ``rank`` runs: those of its place in its pipeline group."""
        return self.actions[self.topology.group_rank("pp", rank)]

    def global_ranks(self, stage: int) -> tuple[int, ...]:
        """The global ranks that run ``stage``: one in each pipeline group, in group order."""
        place = self.stages[stage].rank
        groups = self.topology.group_count("pp")
        return tuple(self.topology.rank_at("pp", g, place) for g in range(groups))

    @property
    def peak_stash(self) -> tuple[int, ...]:
        """The most microbatch activations each pipeline rank holds at once: one per
        (stage, microbatch) from its forward until its full or weight backward."""
        return check_actions(self.actions, self.stage_ranks, self.microbatches, zero3=self.zero3)

    def to_csv(self, format: str = "compute_comms") -> str:
        """torch's CSV: one row per pipeline rank, one action per cell (``_dump_csv``).

        ``"compute_comms"`` writes every action, for ``_PipelineScheduleRuntime._load_csv(...,
        format="compute_comms")``; ``"compute_only"`` the compute actions, which torch lowers
        itself.
        """
        if format not in CSV_FORMATS:
            raise ValueError(f"format must be one of {CSV_FORMATS}, got {format!r}")
        out = io.StringIO()
        writer = csv.writer(out)
        for rank in range(self.pp):
            row = self.actions[rank] if format == "compute_comms" else self.compute_order(rank)
            writer.writerow([str(a) for a in row])
        return out.getvalue()

    @classmethod
    def from_csv(
        cls,
        text: str,
        *,
        topology: Topology,
        format: str = "compute_only",
        zero3: bool = False,
        layout: str | None = None,
    ) -> PipelinePlan:
        """A plan from torch's CSV (one row per pipeline rank), checked like any plan.

        The microbatches and stages are read from the actions, each stage's rank from the row
        its actions are in (torch's ``_validate_schedule``). ``"compute_only"`` rows are
        lowered as torch lowers them (``zero3`` adds UNSHARD/RESHARD); ``"compute_comms"``
        rows are taken as they are, with ``zero3`` set where they unshard.

        Args:
            text: the CSV's contents.
            topology: the world the plan runs in; its ``pp`` must be the number of rows.
            format: ``"compute_only"`` or ``"compute_comms"``.
            zero3: with ``"compute_only"``, whether to plan UNSHARD/RESHARD.
            layout: the stages' layers as a Megatron-core layout string, if known.

        Raises:
            ValueError: for a cell that is not an action, a row count other than pp, a stage
                on two ranks, communication in a compute-only CSV, or actions that cannot run.
        """
        if format not in CSV_FORMATS:
            raise ValueError(f"format must be one of {CSV_FORMATS}, got {format!r}")
        rows = [
            [Action.parse(c) for c in row if c.strip()] for row in csv.reader(io.StringIO(text))
        ]
        if len(rows) != topology.pp:
            raise ValueError(
                f"the CSV has {len(rows)} rows but pp = {topology.pp}; torch writes one row "
                "per pipeline rank"
            )
        where: dict[int, int] = {}
        for rank, row in enumerate(rows):
            for leaf in (leaf for a in row for leaf in a.leaves):
                if where.setdefault(leaf.stage, rank) != rank:
                    raise ValueError(
                        f"stage {leaf.stage} has actions on rank {where[leaf.stage]} and rank "
                        f"{rank}; a stage runs on one rank"
                    )
        leaves = [leaf for row in rows for action in row for leaf in action.leaves]
        forwards = {leaf.microbatch or 0 for leaf in leaves if leaf.kind == FORWARD}
        if not forwards or set(where) != set(range(len(where))):
            raise ValueError(
                "the CSV must run stages 0, 1, ... with forwards of microbatches 0, 1, ...; "
                f"it runs stages {sorted(where)}"
            )
        ranks = tuple(where[s] for s in range(len(where)))
        m = max(forwards) + 1
        if format == "compute_only":
            for rank, row in enumerate(rows):
                bad = [a for a in row if not a.is_compute]
                if bad:
                    raise ValueError(
                        f"a compute-only CSV has {bad[0]} on rank {rank}; read it with "
                        "format='compute_comms'"
                    )
            rows = lower(rows, ranks, m, zero3=zero3)
        else:
            zero3 = any(a.kind in (UNSHARD, RESHARD) for row in rows for a in row)
        partition = _layout_partition(layout, len(ranks)) if layout is not None else None
        return _build(
            CUSTOM, m, _placement(ranks, topology.pp), zero3, topology, ranks, partition, rows
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "pipeline_plan",
            "version": PLAN_VERSION,
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "placement": self.placement,
            "zero3": self.zero3,
            "topology": self.topology.to_json(),
            "stages": [
                {"rank": s.rank, "layout": s.layout, "modules": list(s.modules)}
                for s in self.stages
            ],
            # torch's spelling: compact, and what a reader of torch's schedules recognizes
            "actions": [[str(a) for a in row] for row in self.actions],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> PipelinePlan:
        check_header(obj, "pipeline_plan")
        return cls(
            schedule=obj["schedule"],
            microbatches=obj["microbatches"],
            placement=obj["placement"],
            zero3=obj["zero3"],
            topology=Topology.from_json(obj["topology"]),
            stages=tuple(
                Stage(index=i, rank=s["rank"], layout=s["layout"], modules=tuple(s["modules"]))
                for i, s in enumerate(obj["stages"])
            ),
            actions=tuple(tuple(Action.parse(a) for a in row) for row in obj["actions"]),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def plan_pipeline(
    *,
    schedule: str,
    microbatches: int,
    topology: Topology,
    layers: int | None = None,
    layout: str | None = None,
    specs: Sequence[ParamSpec] | None = None,
    stages_per_rank: int | None = None,
    input_weight: int = 1,
    output_weight: int = 1,
    zero3: bool = False,
) -> PipelinePlan:
    """Plan one training step of pipeline parallelism (docs/pipeline.md).

    Give the model one way: ``layers`` (a count of transformer layers), ``layout`` (Megatron-
    core's string, which also fixes the number of stages) or ``specs`` (the parameters; their
    numbered blocks are the layers). Without a layout the layers are spread with the embedding
    and the loss counting as ``input_weight`` and ``output_weight`` layers (torchtitan's rule).

    Args:
        schedule: one of ``SCHEDULES`` (torch's names, any case; ``ZB1P``, ``ZBV`` too).
        microbatches: microbatches per step.
        topology: the world; its ``pp`` groups run the pipeline.
        layers: the number of transformer layers.
        layout: a Megatron-core layout such as ``"Et*3|t*3|t*3|tL"``.
        specs: the model's parameters.
        stages_per_rank: virtual stages per rank (default: the layout's, else 2 for the
            multi-stage schedules and 1 for GPipe and 1F1B).
        input_weight: the embedding's weight in layers, without a layout.
        output_weight: the loss stage's weight (norm and output) in layers.
        zero3: whether the stages' parameters are sharded (ZeRO-3 / ``fully_shard``): plan
            UNSHARD and RESHARD as torch does (prefetching up to three stages).

    Returns:
        The plan, checked: its actions run without deadlock and each send has its receive.

    Raises:
        ValueError: for a schedule torch does not ship, a combination torch refuses (1F1B
            with fewer microbatches than stages, ...), or a partition that does not fit.

    Example:
        >>> plan = plan_pipeline(schedule="Interleaved1F1B", microbatches=4,
        ...                      topology=Topology(pp=2), layers=6)
        >>> plan.layout, plan.stage_ranks
        ('Et|t*2|t*2|tL', (0, 1, 0, 1))
    """
    name = schedule_name(schedule)
    if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
        raise ValueError(f"microbatches must be a positive int, got {microbatches!r}")
    if sum(x is not None for x in (layers, layout, specs)) != 1:
        raise ValueError("give the model exactly one way: layers=, layout= or specs=")
    pp = topology.pp
    v = stages_per_rank
    if layout is not None:
        count = len(parse_layout(layout))
        if count % pp or (v is not None and count != pp * v):
            raise ValueError(
                f"layout {layout!r} has {count} stages, not pp * stages_per_rank = "
                f"{pp} * {v if v is not None else 'v'}; give {pp} stages per virtual stage"
            )
        v = count // pp
    if v is None:
        v = default_stages_per_rank(name)
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise ValueError(f"stages_per_rank must be a positive int, got {v!r}")
    orders = compute_orders(name, pp, microbatches, v)
    placement = placement_of(name)
    ranks = stage_ranks(pp, pp * v, placement)
    weights = {"input_weight": input_weight, "output_weight": output_weight}
    if layout is not None:
        partition = _layout_partition(layout, pp * v)
    elif specs is not None:
        partition = partition_specs(specs, pp * v, **weights)
    else:
        partition = generic_modules(partition_layers(layers, pp * v, **weights))  # type: ignore[arg-type]
    actions = lower(orders, ranks, microbatches, zero3=zero3)
    return _build(name, microbatches, placement, zero3, topology, ranks, partition, actions)


def _layout_partition(layout: str, num_stages: int) -> Partition:
    stages = parse_layout(layout)
    if len(stages) != num_stages:
        raise ValueError(f"layout {layout!r} has {len(stages)} stages, the plan {num_stages}")
    return generic_modules(stages)


def _placement(ranks: Sequence[int], pp: int) -> str:
    for style in ("loop", "v"):
        if len(ranks) % pp == 0 and tuple(ranks) == stage_ranks(pp, len(ranks), style):
            return style
    return "custom"


def _build(
    schedule: str,
    microbatches: int,
    placement: str,
    zero3: bool,
    topology: Topology,
    ranks: Sequence[int],
    partition: Partition | None,
    actions: Sequence[Sequence[Action]],
) -> PipelinePlan:
    parts = partition if partition is not None else (("", ()),) * len(ranks)
    stages = tuple(
        Stage(index=i, rank=rank, layout=tokens, modules=modules)
        for i, (rank, (tokens, modules)) in enumerate(zip(ranks, parts, strict=True))
    )
    return PipelinePlan(
        schedule=schedule,
        microbatches=microbatches,
        placement=placement,
        zero3=zero3,
        topology=topology,
        stages=stages,
        actions=tuple(tuple(row) for row in actions),
    )
