"""gradsync_jax: executes gradsync_core plans with jax."""

from gradsync_jax._accumulate import accumulate_local_grads, split_microbatches
from gradsync_jax._checkpoint import load_optimizer_state, save_optimizer_state
from gradsync_jax._layers import (
    ColumnParallelLinear,
    MLPBlock,
    MLPTransformer,
    ParallelMLPBlock,
    ParallelMLPTransformer,
    RowParallelLinear,
    nnx_functional,
    shared_param_specs,
)
from gradsync_jax._mappings import (
    all_gather_from,
    copy_to,
    gather_from,
    make_shared_local,
    mesh_axes,
    reduce_from,
    reduce_scatter_to,
    reduce_shared_gradients,
    scatter_to,
)
from gradsync_jax._mesh import mesh_from_topology
from gradsync_jax._naming import from_torch_state, to_torch_state, torch_names, torch_specs
from gradsync_jax._specs import param_specs, path_name
from gradsync_jax._step import data_parallel_step
from gradsync_jax._sync import local_grad, make_local, sync_gradients, value_and_local_grad
from gradsync_jax._zero import ShardedOptimizer, ZeroState, shard_optimizer
from gradsync_jax._zero_clip import clip_by_global_norm
from gradsync_jax._zero_flat import NotElementwiseError

__all__: list[str] = [
    "ColumnParallelLinear",
    "MLPBlock",
    "MLPTransformer",
    "NotElementwiseError",
    "ParallelMLPBlock",
    "ParallelMLPTransformer",
    "RowParallelLinear",
    "ShardedOptimizer",
    "ZeroState",
    "accumulate_local_grads",
    "all_gather_from",
    "clip_by_global_norm",
    "copy_to",
    "data_parallel_step",
    "from_torch_state",
    "gather_from",
    "load_optimizer_state",
    "local_grad",
    "make_local",
    "make_shared_local",
    "mesh_axes",
    "mesh_from_topology",
    "nnx_functional",
    "param_specs",
    "path_name",
    "reduce_from",
    "reduce_scatter_to",
    "reduce_shared_gradients",
    "save_optimizer_state",
    "scatter_to",
    "shard_optimizer",
    "shared_param_specs",
    "split_microbatches",
    "sync_gradients",
    "to_torch_state",
    "torch_names",
    "torch_specs",
    "value_and_local_grad",
]
