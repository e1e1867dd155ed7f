"""Pipeline parallelism as planner data (docs/pipeline.md).

One module per concept: the action grammar, the schedules, torch's lowering passes, the layer
partition, the plan value, and the validator and simulator (docs/design-names-and-layout.md).
"""

from gradsync_core.plan.pipeline._actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMMS,
    COMPUTE,
    FORWARD,
    FULL_BACKWARD,
    KINDS,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    STAGE_ONLY,
    UNSHARD,
    Action,
)
from gradsync_core.plan.pipeline._layout import (
    parse_layout,
    partition_layers,
)
from gradsync_core.plan.pipeline._plan import (
    PipelinePlan,
    Stage,
    plan_pipeline,
)
from gradsync_core.plan.pipeline._schedules import (
    SCHEDULES,
)
from gradsync_core.plan.pipeline._sim import (
    PipelineSimulation,
    TimedAction,
    check_actions,
    simulate_pipeline,
)

__all__ = [
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "COMMS",
    "COMPUTE",
    "FORWARD",
    "FULL_BACKWARD",
    "KINDS",
    "OVERLAP_F_B",
    "RECV_B",
    "RECV_F",
    "REDUCE_GRAD",
    "RESHARD",
    "SCHEDULES",
    "SEND_B",
    "SEND_F",
    "STAGE_ONLY",
    "UNSHARD",
    "Action",
    "PipelinePlan",
    "PipelineSimulation",
    "Stage",
    "TimedAction",
    "check_actions",
    "parse_layout",
    "partition_layers",
    "plan_pipeline",
    "simulate_pipeline",
]
