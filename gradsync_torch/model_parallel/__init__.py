"""Tensor/context-parallel building blocks for torch (docs/design.md §5, §6).

``groups`` turns a ``Topology`` into named process groups and sums shared-parameter
gradients over them; ``mappings`` holds the autograd collectives that cross a group
boundary; ``layers`` builds the column/row-parallel linears on top of both.
"""

from gradsync_torch.model_parallel.groups import (
    Group,
    ProcessGroups,
    check_reduction_plan,
    reduce_shared_gradients,
)
from gradsync_torch.model_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    local_state,
    replicated_over,
    shared_param_specs,
)
from gradsync_torch.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)

__all__: list[str] = [
    "ColumnParallelLinear",
    "Group",
    "ProcessGroups",
    "RowParallelLinear",
    "all_gather_from",
    "check_reduction_plan",
    "copy_to",
    "gather_from",
    "local_state",
    "reduce_from",
    "reduce_scatter_to",
    "reduce_shared_gradients",
    "replicated_over",
    "scatter_to",
    "shared_param_specs",
]
