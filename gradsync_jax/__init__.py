"""The JAX executor: runs gradsync_core's plans in ``jax.shard_map``, with sharded Optax."""

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
from gradsync_jax.checkpoint import load_optimizer_state, load_params, save_optimizer_state
from gradsync_jax.checkpoint.orbax import export_orbax, import_orbax
from gradsync_jax.checkpoint.param_shards import load_param_shards, save_param_shards
from gradsync_jax.data_parallel import (
    SyncedState,
    accumulate_local_grads,
    data_parallel_step,
    local_grad,
    make_local,
    split_microbatches,
    sync_gradients,
    synced,
    value_and_local_grad,
)
from gradsync_jax.model_parallel import (
    ColumnParallelLinear,
    MoE,
    RowParallelLinear,
    all_gather_from,
    copy_to,
    gather_from,
    group_axes,
    nnx_functional,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
    shared_param_specs,
)
from gradsync_jax.param_sharding import (
    MixedPrecisionPolicy,
    ParamLayout,
    Zero3Step,
    param_layout,
    shard_params,
    unshard_params,
    zero3_step,
)
from gradsync_jax.sampler import ResumableSampler
from gradsync_jax.shared_reductions import make_shared_local, reduce_shared_gradients
from gradsync_jax.zero import (
    NotElementwiseError,
    ShardedOptimizer,
    ZeroState,
    clip_by_global_norm,
    shard_optimizer,
)

__all__: list[str] = [
    "ColumnParallelLinear",
    "MixedPrecisionPolicy",
    "MoE",
    "NotElementwiseError",
    "ParamLayout",
    "ResumableSampler",
    "RowParallelLinear",
    "ShardedOptimizer",
    "SyncedState",
    "Zero3Step",
    "ZeroState",
    "accumulate_local_grads",
    "all_gather_from",
    "clip_by_global_norm",
    "copy_to",
    "data_parallel_step",
    "export_orbax",
    "from_torch_state",
    "gather_from",
    "group_axes",
    "import_orbax",
    "load_optimizer_state",
    "load_param_shards",
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
    "save_param_shards",
    "scatter_to",
    "shard_optimizer",
    "shard_params",
    "shared_param_specs",
    "split_microbatches",
    "sync_gradients",
    "synced",
    "to_torch_state",
    "torch_names",
    "torch_plan",
    "torch_specs",
    "unshard_params",
    "value_and_local_grad",
    "zero3_step",
]
