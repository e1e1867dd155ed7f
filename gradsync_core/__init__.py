"""gradsync_core: the framework-free planner (bucket layouts, shard partitions, topologies).

Standard library only. The same parameter list gives the same plan, byte for byte, whichever
framework asks for it; the executors in ``gradsync_torch`` and ``gradsync_jax`` run the plans.
The top level holds what users call; the checkpoint format and save protocol the executors
implement live in the documented submodule ``gradsync_core.checkpoint``.
"""

from gradsync_core._buckets import (
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
    rebuild_buckets,
)
from gradsync_core._canonical import PLAN_VERSION, canonical_json, fingerprint
from gradsync_core._checkpoint import FORMAT_VERSION, Manifest, read_manifest
from gradsync_core._hyperparams import HyperparameterWarning
from gradsync_core._memory import (
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    RankMemory,
    estimate_ddp,
    estimate_zero1,
    estimate_zero2,
    estimate_zero3,
    optimizer_state_bytes,
)
from gradsync_core._models import MODELS, builtin_model
from gradsync_core._param_shards import (
    ParamChunk,
    ParamShardPlan,
    ShardedParam,
    Unit,
    chunk_rows,
    plan_param_shards,
)
from gradsync_core._param_units import block_prefixes
from gradsync_core._pipeline import PipelinePlan, Stage, plan_pipeline
from gradsync_core._pipeline_actions import Action
from gradsync_core._pipeline_layout import parse_layout, partition_layers
from gradsync_core._pipeline_schedules import SCHEDULES
from gradsync_core._pipeline_sim import (
    PipelineSimulation,
    TimedAction,
    check_actions,
    simulate_pipeline,
)
from gradsync_core._rank_generator import RankGenerator
from gradsync_core._reductions import (
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
from gradsync_core._sampler import LAST_BATCH, DataCursor, SamplerPlan
from gradsync_core._save_protocol import CheckpointError
from gradsync_core._shards import Shard, ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core._specs import DTYPE_ITEMSIZE, ParamSpec, itemsize
from gradsync_core._state_keys import COUNTERPARTS
from gradsync_core._topology import (
    AXES,
    DEFAULT_ORDER,
    EXPERT_AXES,
    EXPERT_GROUPS,
    STANDARD_GROUPS,
    Topology,
    split_shapes,
)

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "COUNTERPARTS",
    "DEFAULT_CAP_BYTES",
    "DEFAULT_FIRST_CAP_BYTES",
    "DEFAULT_LEGACY_MAX_NUMEL",
    "DEFAULT_ORDER",
    "DTYPE_ITEMSIZE",
    "EXPERT_AXES",
    "EXPERT_GROUPS",
    "FORMAT_VERSION",
    "LAST_BATCH",
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
    "CheckpointError",
    "DataCursor",
    "HyperparameterWarning",
    "Manifest",
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
    "estimate_ddp",
    "estimate_zero1",
    "estimate_zero2",
    "estimate_zero3",
    "expert_reduction_group",
    "fingerprint",
    "itemsize",
    "optimizer_state_bytes",
    "parse_layout",
    "partition_layers",
    "plan_buckets",
    "plan_flat_shards",
    "plan_greedy_shards",
    "plan_legacy_buckets",
    "plan_param_shards",
    "plan_pipeline",
    "plan_shared_reductions",
    "read_manifest",
    "rebuild_buckets",
    "reduction_group",
    "replicated_axes",
    "simulate_pipeline",
    "split_expert_specs",
    "split_shapes",
    "with_replicated_over",
]
