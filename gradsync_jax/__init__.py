"""gradsync_jax: executes gradsync_core plans with jax."""

from gradsync_jax._accumulate import accumulate_local_grads, split_microbatches
from gradsync_jax._mesh import mesh_from_topology
from gradsync_jax._naming import (
    from_torch_state,
    registration_order,
    to_torch_state,
    torch_names,
    torch_plan,
    torch_specs,
)
from gradsync_jax._specs import param_specs, path_name
from gradsync_jax._step import data_parallel_step
from gradsync_jax._sync import local_grad, make_local, sync_gradients, value_and_local_grad
from gradsync_jax.model_parallel import (
    ColumnParallelLinear,
    MoE,
    RowParallelLinear,
    all_gather_from,
    copy_to,
    gather_from,
    group_axes,
    make_shared_local,
    nnx_functional,
    reduce_from,
    reduce_scatter_to,
    reduce_shared_gradients,
    scatter_to,
    shared_param_specs,
)
from gradsync_jax.model_state import load_params
from gradsync_jax.param_sharding import (
    ParamLayout,
    Zero3Step,
    param_layout,
    shard_params,
    unshard_params,
    zero3_step,
)
from gradsync_jax.sampler import ResumableSampler
from gradsync_jax.zero import (
    NotElementwiseError,
    ShardedOptimizer,
    ZeroState,
    clip_by_global_norm,
    load_optimizer_state,
    save_optimizer_state,
    shard_optimizer,
)

__all__: list[str] = [
    "ColumnParallelLinear",
    "MoE",
    "NotElementwiseError",
    "ParamLayout",
    "ResumableSampler",
    "RowParallelLinear",
    "ShardedOptimizer",
    "Zero3Step",
    "ZeroState",
    "accumulate_local_grads",
    "all_gather_from",
    "clip_by_global_norm",
    "copy_to",
    "data_parallel_step",
    "from_torch_state",
    "gather_from",
    "group_axes",
    "load_optimizer_state",
    "load_params",
    "local_grad",
    "make_local",
    "make_shared_local",
    "mesh_from_topology",
    "nnx_functional",
    "param_layout",
    "param_specs",
    "path_name",
    "reduce_from",
    "reduce_scatter_to",
    "reduce_shared_gradients",
    "registration_order",
    "save_optimizer_state",
    "scatter_to",
    "shard_optimizer",
    "shard_params",
    "shared_param_specs",
    "split_microbatches",
    "sync_gradients",
    "to_torch_state",
    "torch_names",
    "torch_plan",
    "torch_specs",
    "unshard_params",
    "value_and_local_grad",
    "zero3_step",
]
