"""gradsync_core: the framework-free planner (bucket layouts, shard partitions, topologies).

Standard library only. The same parameter list gives the same plan, byte for byte, whichever
framework asks for it; the executors in ``gradsync_torch`` and ``gradsync_jax`` run the plans.
"""

from gradsync_core._buckets import (
    DEFAULT_CAP_BYTES,
    DEFAULT_FIRST_CAP_BYTES,
    DEFAULT_LEGACY_MAX_NUMEL,
    Bucket,
    BucketPlan,
    Slot,
    describe_difference,
    plan_buckets,
    plan_legacy_buckets,
    rebuild_buckets,
)
from gradsync_core._canonical import PLAN_VERSION, canonical_json, fingerprint
from gradsync_core._checkpoint import (
    OPTAX_TO_TORCH_STATE,
    TORCH_TO_OPTAX_STATE,
    Manifest,
    check_compatible,
    read_manifest,
    write_manifest,
)
from gradsync_core._models import MODELS, builtin_model
from gradsync_core._shards import Shard, ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core._specs import DTYPE_ITEMSIZE, ParamSpec, itemsize
from gradsync_core._topology import AXES, DEFAULT_ORDER, STANDARD_GROUPS, Topology, split_shapes

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "DEFAULT_CAP_BYTES",
    "DEFAULT_FIRST_CAP_BYTES",
    "DEFAULT_LEGACY_MAX_NUMEL",
    "DEFAULT_ORDER",
    "DTYPE_ITEMSIZE",
    "MODELS",
    "OPTAX_TO_TORCH_STATE",
    "PLAN_VERSION",
    "STANDARD_GROUPS",
    "TORCH_TO_OPTAX_STATE",
    "Bucket",
    "BucketPlan",
    "Manifest",
    "ParamSpec",
    "Shard",
    "ShardPlan",
    "Slot",
    "Topology",
    "builtin_model",
    "canonical_json",
    "check_compatible",
    "describe_difference",
    "fingerprint",
    "itemsize",
    "plan_buckets",
    "plan_flat_shards",
    "plan_greedy_shards",
    "plan_legacy_buckets",
    "read_manifest",
    "rebuild_buckets",
    "split_shapes",
    "write_manifest",
]
