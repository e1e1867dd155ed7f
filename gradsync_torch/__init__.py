"""The torch executor: runs gradsync_core's plans on ``torch.distributed``."""

from gradsync_torch._specs import dtype_name, param_specs, replicated_over, shared_param_specs
from gradsync_torch.agreement import Disagreement, agree_ok, agree_on
from gradsync_torch.checkpoint import (
    Held,
    PreemptionHandler,
    box_of,
    load_boxes,
    load_model_weights,
    load_optimizer_state_dict,
    load_param_shards,
    save_boxes,
    save_param_shards,
)
from gradsync_torch.checkpoint import (
    load_fully_sharded as load_fully_sharded,  # deprecated alias of load_param_shards
)
from gradsync_torch.checkpoint import (
    save_fully_sharded as save_fully_sharded,  # deprecated alias of save_param_shards
)
from gradsync_torch.checkpoint.dcp import export_dcp, import_dcp
from gradsync_torch.cost import calibrate, profile_model
from gradsync_torch.data_parallel import DataParallel, DataParallelOptions, ShardedGradient
from gradsync_torch.data_parallel.comm_hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from gradsync_torch.groups import Group, ProcessGroups
from gradsync_torch.matrices import MatrixOptimizer
from gradsync_torch.model_parallel.experts import ExpertMLPs, MoE
from gradsync_torch.model_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    local_state,
)
from gradsync_torch.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)
from gradsync_torch.param_sharding import (
    MixedPrecisionPolicy,
    ShardedModule,
    fully_shard,
    hsdp_mesh,
)
from gradsync_torch.pipeline import (
    Pipeline,
    StageModule,
    StageSplit,
    load_pipeline,
    save_pipeline,
    split_model,
)
from gradsync_torch.sampler import ResumableSampler
from gradsync_torch.shared_reductions import (
    SharedReducer,
    check_reduction_plan,
    reduce_shared_gradients,
)
from gradsync_torch.zero import ZeroRedundancyOptimizer
from gradsync_torch.zero.clip import clip_sharded_

__all__: list[str] = [
    "ColumnParallelLinear",
    "DataParallel",
    "DataParallelOptions",
    "Disagreement",
    "ExpertMLPs",
    "GradBucket",
    "Group",
    "Held",
    "MatrixOptimizer",
    "MixedPrecisionPolicy",
    "MoE",
    "Pipeline",
    "PreemptionHandler",
    "ProcessGroups",
    "ResumableSampler",
    "RowParallelLinear",
    "ShardedGradient",
    "ShardedModule",
    "SharedReducer",
    "StageModule",
    "StageSplit",
    "ZeroRedundancyOptimizer",
    "agree_ok",
    "agree_on",
    "all_gather_from",
    "allreduce_hook",
    "bf16_compress_hook",
    "box_of",
    "calibrate",
    "check_reduction_plan",
    "clip_sharded_",
    "copy_to",
    "dtype_name",
    "export_dcp",
    "fp16_compress_hook",
    "fully_shard",
    "gather_from",
    "hsdp_mesh",
    "import_dcp",
    "load_boxes",
    "load_model_weights",
    "load_optimizer_state_dict",
    "load_param_shards",
    "load_pipeline",
    "local_state",
    "param_specs",
    "profile_model",
    "reduce_from",
    "reduce_scatter_to",
    "reduce_shared_gradients",
    "replicated_over",
    "save_boxes",
    "save_param_shards",
    "save_pipeline",
    "scatter_to",
    "shared_param_specs",
    "split_model",
]
