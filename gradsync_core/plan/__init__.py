"""The planners: pure functions from plain data to frozen plan values.

Inputs are parameter specs, sizes and names; every plan has canonical JSON and a fingerprint
(docs/design.md §2-§8). One module per concept (docs/design-names-and-layout.md). Nothing here
reads a file, the environment or a framework.
"""

from gradsync_core.plan._buckets import (
    DEFAULT_CAP_BYTES,
    DEFAULT_FIRST_CAP_BYTES,
    DEFAULT_LEGACY_MAX_NUMEL,
    MIB,
    Bucket,
    BucketPlan,
    Slot,
    bucket_caps,
    describe_difference,
    plan_buckets,
    plan_legacy_buckets,
    plan_param_buckets,
    rebuild_buckets,
)
from gradsync_core.plan._canonical import (
    PLAN_VERSION,
    canonical_json,
    fingerprint,
)
from gradsync_core.plan._mean import (
    MEAN_RULES,
    MeanDivisors,
    divides_after,
    mean_divisors,
)
from gradsync_core.plan._memory import (
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    RankMemory,
    estimate_ddp,
    estimate_zero1,
    estimate_zero2,
    estimate_zero3,
    optimizer_state_bytes,
)
from gradsync_core.plan._models import (
    MODELS,
    builtin_model,
)
from gradsync_core.plan._param_shards import (
    ParamChunk,
    ParamShardPlan,
    ShardedParam,
    Unit,
    chunk_rows,
    plan_param_shards,
)
from gradsync_core.plan._param_units import (
    block_prefixes,
)
from gradsync_core.plan._rank_generator import (
    HSDP_AXES,
    RankGenerator,
)
from gradsync_core.plan._reductions import (
    MODEL_AXES,
    ReductionPlan,
    SharedReduction,
    expert_reduction_group,
    plan_shared_reductions,
    reduction_group,
    replicated_axes,
    split_expert_specs,
    with_replicated_over,
)
from gradsync_core.plan._sampler import (
    LAST_BATCH,
    DataCursor,
    SamplerPlan,
)
from gradsync_core.plan._shards import (
    Shard,
    ShardPlan,
    plan_flat_shards,
    plan_greedy_shards,
)
from gradsync_core.plan._specs import (
    DTYPE_ITEMSIZE,
    ParamSpec,
    itemsize,
)
from gradsync_core.plan._topology import (
    AXES,
    DEFAULT_ORDER,
    EXPERT_AXES,
    EXPERT_GROUPS,
    STANDARD_GROUPS,
    Topology,
    split_shapes,
)
from gradsync_core.plan.pipeline import (
    SCHEDULES,
    Action,
    PipelinePlan,
    PipelineSimulation,
    Stage,
    TimedAction,
    check_actions,
    parse_layout,
    partition_layers,
    plan_pipeline,
    simulate_pipeline,
)

__all__ = [
    "AXES",
    "DEFAULT_CAP_BYTES",
    "DEFAULT_FIRST_CAP_BYTES",
    "DEFAULT_LEGACY_MAX_NUMEL",
    "DEFAULT_ORDER",
    "DTYPE_ITEMSIZE",
    "EXPERT_AXES",
    "EXPERT_GROUPS",
    "HSDP_AXES",
    "LAST_BATCH",
    "MEAN_RULES",
    "MIB",
    "MODELS",
    "MODEL_AXES",
    "OPTIMIZER_STATE_BYTES",
    "PLAN_VERSION",
    "SCHEDULES",
    "STANDARD_GROUPS",
    "Action",
    "Bucket",
    "BucketPlan",
    "DataCursor",
    "MeanDivisors",
    "MemoryEstimate",
    "ParamChunk",
    "ParamShardPlan",
    "ParamSpec",
    "PipelinePlan",
    "PipelineSimulation",
    "RankGenerator",
    "RankMemory",
    "ReductionPlan",
    "SamplerPlan",
    "Shard",
    "ShardPlan",
    "ShardedParam",
    "SharedReduction",
    "Slot",
    "Stage",
    "TimedAction",
    "Topology",
    "Unit",
    "block_prefixes",
    "bucket_caps",
    "builtin_model",
    "canonical_json",
    "check_actions",
    "chunk_rows",
    "describe_difference",
    "divides_after",
    "estimate_ddp",
    "estimate_zero1",
    "estimate_zero2",
    "estimate_zero3",
    "expert_reduction_group",
    "fingerprint",
    "itemsize",
    "mean_divisors",
    "optimizer_state_bytes",
    "parse_layout",
    "partition_layers",
    "plan_buckets",
    "plan_flat_shards",
    "plan_greedy_shards",
    "plan_legacy_buckets",
    "plan_param_buckets",
    "plan_param_shards",
    "plan_pipeline",
    "plan_shared_reductions",
    "rebuild_buckets",
    "reduction_group",
    "replicated_axes",
    "simulate_pipeline",
    "split_expert_specs",
    "split_shapes",
    "with_replicated_over",
]
