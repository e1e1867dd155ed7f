"""The cost model: a plan's predicted step time, exposed communication and memory.

Two profiles and the plans: a machine profile (each collective's latency and bus bandwidth,
``_machine``), a model profile (each block's forward and backward time, ``_model_profile``),
the timelines that put them together (``_timeline`` for data parallelism and ZeRO,
``_pipeline_cost`` on top of the pipeline simulator), ``predict`` for one configuration and the
search over all of them (``_search``). Standard library only, like every planner.
"""

from gradsync_core.plan.cost._data_parallel_cost import predict_data_parallel
from gradsync_core.plan.cost._machine import (
    COLLECTIVES,
    LinkCost,
    MachineProfile,
    bus_factor,
    fit_link,
)
from gradsync_core.plan.cost._model_profile import (
    BlockTime,
    ModelProfile,
    estimate_model_profile,
    median_profile,
    profile_blocks,
)
from gradsync_core.plan.cost._pipeline_cost import predict_pipeline
from gradsync_core.plan.cost._predict import Configuration, Prediction, predict
from gradsync_core.plan.cost._search import (
    Dropped,
    SearchResult,
    configurations,
    rank_key,
    search_configurations,
)
from gradsync_core.plan.cost._timeline import CommEvent, RankCost, StepCost
from gradsync_core.plan.cost._zero3_cost import predict_zero3

__all__ = [
    "COLLECTIVES",
    "BlockTime",
    "CommEvent",
    "Configuration",
    "Dropped",
    "LinkCost",
    "MachineProfile",
    "ModelProfile",
    "Prediction",
    "RankCost",
    "SearchResult",
    "StepCost",
    "bus_factor",
    "configurations",
    "estimate_model_profile",
    "fit_link",
    "median_profile",
    "predict",
    "predict_data_parallel",
    "predict_pipeline",
    "predict_zero3",
    "profile_blocks",
    "rank_key",
    "search_configurations",
]
