"""Model parallelism in ``jax.shard_map``: the six mappings, NNX layers, the MoE block (design §6).

See docs/design.md §5 and §6.
"""

from gradsync_jax.model_parallel.experts import MoE
from gradsync_jax.model_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    nnx_functional,
    shared_param_specs,
)
from gradsync_jax.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    gather_from,
    group_axes,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)
from gradsync_jax.shared_reductions import make_shared_local, reduce_shared_gradients

__all__: list[str] = [
    "ColumnParallelLinear",
    "MoE",
    "RowParallelLinear",
    "all_gather_from",
    "copy_to",
    "gather_from",
    "group_axes",
    "make_shared_local",
    "nnx_functional",
    "reduce_from",
    "reduce_scatter_to",
    "reduce_shared_gradients",
    "scatter_to",
    "shared_param_specs",
]
