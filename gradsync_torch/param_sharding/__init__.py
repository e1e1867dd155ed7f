"""Parameter sharding (ZeRO-3) for torch: FSDP2's ``fully_shard`` API over a gradsync plan.

Switching from FSDP2 is a change of import (docs/torch-zero3.md):
``from gradsync_torch import fully_shard, MixedPrecisionPolicy``.
"""

from gradsync_torch.param_sharding._api import fully_shard
from gradsync_torch.param_sharding._divide import gradient_divide
from gradsync_torch.param_sharding._mesh import hsdp_mesh
from gradsync_torch.param_sharding._module import ShardedModule
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy

__all__ = [
    "MixedPrecisionPolicy",
    "ShardedModule",
    "fully_shard",
    "gradient_divide",
    "hsdp_mesh",
]
