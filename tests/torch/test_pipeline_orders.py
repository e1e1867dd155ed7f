"""gradsync_core's pipeline schedules run torch 2.13's per-rank order (docs/pipeline.md).

No process group is needed: torch's runtime schedules compute ``pipeline_order`` (and lower it
to ``pipeline_order_with_comms``) in their constructors from the stages' indices and group
size alone, so stand-in stages carry just those; GPipe and 1F1B are compared with what their
``_step_microbatches`` runs, recorded by a stand-in stage whose communication is empty (their
``_get_pipeline_order`` only illustrates: at pp 4 it lists no F0 on the last rank).

The sweep: every schedule torch ships, pp 2/3/4/8, 1 to 16 microbatches, 1 to 4 stages per rank
for the looped schedules (1 to 3 for the V ones, which torch refuses unless 2). Each case
either matches torch's order action for action, or both refuse it.
"""

import itertools
import types
from pathlib import Path

import pytest
from torch.distributed.pipelining import schedules as torch_schedules
from torch.distributed.pipelining._utils import generate_rank_to_stage_mapping

from gradsync_core import SCHEDULES, PipelinePlan, Topology, plan_pipeline

pytestmark = pytest.mark.slow

CLASSES = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": torch_schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
    "DualPipeV": torch_schedules.ScheduleDualPipeV,
}
PP = (2, 3, 4, 8)
MICROBATCHES = range(1, 17)
STAGES_PER_RANK = {"GPipe": (1,), "1F1B": (1,), "ZBVZeroBubble": (1, 2, 3), "DualPipeV": (1, 2, 3)}
# (matched, refused by both) per schedule: the sweep's size, so it cannot shrink unnoticed.
EXPECTED = {
    "GPipe": (64, 0),
    "1F1B": (51, 13),  # torch: microbatches >= stages
    "Interleaved1F1B": (192, 64),  # torch: microbatches a multiple of max(1, m // pp)
    "LoopedBFS": (256, 0),
    "InterleavedZeroBubble": (192, 64),  # as interleaved 1F1B
    "ZBVZeroBubble": (64, 128),  # torch: exactly 2 stages per rank
    "DualPipeV": (34, 158),  # torch: 2 stages per rank and microbatches >= stages
}
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")


class RecordingStage:
    """A single-stage schedule's stage that records what the schedule runs on it."""

    def __init__(self, index, num_stages):
        self.stage_index, self.num_stages = index, num_stages
        self.group_size, self.group_rank = num_stages, index
        self.is_first, self.is_last = index == 0, index == num_stages - 1
        self.submod = None
        self.ran = []

    def get_fwd_recv_ops(self, mb):
        return []

    get_fwd_send_ops = get_bwd_recv_ops = get_bwd_send_ops = get_fwd_recv_ops

    def forward_one_chunk(self, mb, *args, **kwargs):
        self.ran.append(f"{self.stage_index}F{mb}")

    def backward_one_chunk(self, mb, **kwargs):
        self.ran.append(f"{self.stage_index}B{mb}")

    def perform_reduce_grad(self, scale):
        self.ran.append(f"{self.stage_index}REDUCE_GRAD")


def torch_single(name, pp, m):
    """What GPipe's or 1F1B's ``_step_microbatches`` runs on each rank."""
    out = []
    for rank in range(pp):
        stage = RecordingStage(rank, pp)
        schedule = CLASSES[name](stage, m)
        schedule._initialize_stage = lambda *args, **kwargs: None  # no tensors to probe
        schedule._step_microbatches()
        out.append(stage.ran)
    return out


def torch_multi(name, pp, m, v):
    """A runtime schedule built on rank 0's stand-in stages: its orders cover every rank."""
    style = "v" if name in V_SHAPED else "loop"
    stages = [
        types.SimpleNamespace(
            stage_index=s, num_stages=pp * v, group_size=pp, group_rank=0, submod=None
        )
        for s in generate_rank_to_stage_mapping(pp, pp * v, style)[0]
    ]
    return CLASSES[name](stages, m)


def strings(rows):
    return [[str(a) for a in row if a is not None] for row in rows]


def ours(name, pp, m, v, zero3=False):
    return plan_pipeline(
        schedule=name,
        microbatches=m,
        topology=Topology(pp=pp),
        layers=2 * pp * v,
        stages_per_rank=v,
        zero3=zero3,
    )


@pytest.mark.parametrize("name", SCHEDULES)
def test_per_rank_order_is_torchs(name):
    matched = refused = 0
    for pp, m, v in itertools.product(PP, MICROBATCHES, STAGES_PER_RANK.get(name, (1, 2, 3, 4))):
        case = f"{name} pp={pp} m={m} v={v}"
        try:
            if name in ("GPipe", "1F1B"):
                want, want_comms = torch_single(name, pp, m), None
            else:
                schedule = torch_multi(name, pp, m, v)
                want = strings(schedule.pipeline_order[r] for r in range(pp))
                want_comms = strings(schedule.pipeline_order_with_comms[r] for r in range(pp))
        except ValueError as torch_refusal:
            with pytest.raises(ValueError):
                ours(name, pp, m, v)
            refused += 1
            assert str(torch_refusal)  # both refuse, each with its sentence
            continue
        # torch always plans UNSHARD/RESHARD (no-ops without FSDP): with zero3 every action,
        # sends, receives and reductions included, is torch's, in torch's place.
        plan = ours(name, pp, m, v, zero3=want_comms is not None)
        got = [[str(a) for a in plan.compute_order(r)] for r in range(pp)]
        if want_comms is None:  # the single-stage runs end with the stage's reduction
            got = [[*row, f"{r}REDUCE_GRAD"] for r, row in enumerate(got)]
        assert got == want, case
        assert want_comms is None or strings(plan.actions) == want_comms, case
        matched += 1
    assert (matched, refused) == EXPECTED[name]


@pytest.mark.parametrize(
    ("name", "pp", "m"), [("Interleaved1F1B", 4, 8), ("ZBVZeroBubble", 2, 5), ("DualPipeV", 3, 6)]
)
def test_torch_runs_our_csv_and_we_read_torchs(name, pp, m, tmp_path):
    plan = ours(name, pp, m, 2, zero3=True)
    ours_csv = tmp_path / "ours.csv"
    ours_csv.write_text(plan.to_csv())
    runtime = torch_multi(name, pp, m, 2)
    runtime._load_csv(str(ours_csv), format="compute_comms")
    assert strings(runtime.pipeline_order_with_comms[r] for r in range(pp)) == strings(plan.actions)
    theirs = tmp_path / "theirs.csv"
    for fmt in ("compute_only", "compute_comms"):
        torch_multi(name, pp, m, 2)._dump_csv(str(theirs), format=fmt)
        read = PipelinePlan.from_csv(
            theirs.read_text(), topology=Topology(pp=pp), format=fmt, zero3=True
        )
        assert read.actions == plan.actions and read.stage_ranks == plan.stage_ranks


@pytest.mark.parametrize(
    ("name", "pp", "m", "v"),
    [("GPipe", 4, 6, 1), ("1F1B", 8, 9, 1), ("LoopedBFS", 3, 4, 3), ("ZB1P", 4, 8, 2)],
)
def test_torchs_own_simulator_finds_no_deadlock_in_our_plans(name, pp, m, v):
    plan = ours(name, pp, m, v)
    # torch's dry run reads compute and point-to-point actions only
    order = {
        r: [
            torch_schedules._Action.from_str(str(a))
            for a in plan.actions[r]
            if a.kind != "REDUCE_GRAD"
        ]
        for r in range(pp)
    }
    timeline = torch_schedules._simulate_comms_compute(
        order, lambda s: plan.stage_ranks[s], plan.num_stages
    )
    assert sum(a is not None for row in timeline.values() for a in row) == sum(
        len(row) for row in order.values()
    )


def test_the_docs_state_the_sweeps_size():
    doc = " ".join((Path(__file__).parents[2] / "docs" / "pipeline.md").read_text().split())
    matched = sum(m for m, _ in EXPECTED.values())
    refused = sum(r for _, r in EXPECTED.values())
    assert f"{matched} cases equal to torch's, action for action, and {refused} that" in doc
