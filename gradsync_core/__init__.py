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
from gradsync_core._models import MODELS, builtin_model
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
    "MIB",
    "MODELS",
    "MODEL_AXES",
    "PLAN_VERSION",
    "STANDARD_GROUPS",
    "Bucket",
    "BucketPlan",
    "CheckpointError",
    "Manifest",
    "ParamSpec",
    "RankGenerator",
    "ReductionPlan",
    "Shard",
    "ShardPlan",
    "SharedReduction",
    "Slot",
    "Topology",
    "bucket_caps",
    "builtin_model",
    "canonical_json",
    "describe_difference",
    "expert_reduction_group",
    "fingerprint",
    "itemsize",
    "plan_buckets",
    "plan_flat_shards",
    "plan_greedy_shards",
    "plan_legacy_buckets",
    "plan_shared_reductions",
    "read_manifest",
    "rebuild_buckets",
    "reduction_group",
    "replicated_axes",
    "split_expert_specs",
    "split_shapes",
    "with_replicated_over",
]
