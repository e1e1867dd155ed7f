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
    FORMAT_VERSION,
    MANIFEST,
    MODEL_PARAM,
    OPTAX_TO_TORCH_STATE,
    RANK_FILE_RE,
    TORCH_TO_OPTAX_STATE,
    Manifest,
    check_compatible,
    model_key,
    model_owners,
    rank_file,
    read_manifest,
    sha256_file,
    tensor_key,
    verify_file_hashes,
    write_atomic,
    write_manifest,
)
from gradsync_core._models import MODELS, builtin_model
from gradsync_core._reductions import (
    MODEL_AXES,
    ReductionPlan,
    SharedReduction,
    plan_shared_reductions,
    reduction_group,
    replicated_axes,
    with_replicated_over,
)
from gradsync_core._shards import Shard, ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core._specs import DTYPE_ITEMSIZE, ParamSpec, itemsize
from gradsync_core._state_keys import (
    COUNTERPARTS,
    canonical_state_key,
    check_optimizer,
    check_state_keys,
    counterpart_keys,
    framework_state_key,
)
from gradsync_core._topology import AXES, DEFAULT_ORDER, STANDARD_GROUPS, Topology, split_shapes

__version__ = "0.1.0"

__all__ = [
    "AXES",
    "COUNTERPARTS",
    "DEFAULT_CAP_BYTES",
    "DEFAULT_FIRST_CAP_BYTES",
    "DEFAULT_LEGACY_MAX_NUMEL",
    "DEFAULT_ORDER",
    "DTYPE_ITEMSIZE",
    "FORMAT_VERSION",
    "MANIFEST",
    "MODELS",
    "MODEL_PARAM",
    "MODEL_AXES",
    "OPTAX_TO_TORCH_STATE",
    "PLAN_VERSION",
    "RANK_FILE_RE",
    "STANDARD_GROUPS",
    "TORCH_TO_OPTAX_STATE",
    "Bucket",
    "BucketPlan",
    "Manifest",
    "ParamSpec",
    "ReductionPlan",
    "Shard",
    "ShardPlan",
    "SharedReduction",
    "Slot",
    "Topology",
    "builtin_model",
    "canonical_json",
    "canonical_state_key",
    "check_compatible",
    "check_optimizer",
    "check_state_keys",
    "counterpart_keys",
    "describe_difference",
    "fingerprint",
    "framework_state_key",
    "itemsize",
    "model_key",
    "model_owners",
    "plan_buckets",
    "plan_flat_shards",
    "plan_greedy_shards",
    "plan_legacy_buckets",
    "plan_shared_reductions",
    "rank_file",
    "read_manifest",
    "rebuild_buckets",
    "reduction_group",
    "replicated_axes",
    "sha256_file",
    "split_shapes",
    "tensor_key",
    "verify_file_hashes",
    "with_replicated_over",
    "write_atomic",
    "write_manifest",
]
