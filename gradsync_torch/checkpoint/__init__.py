"""Checkpoints in torch: gradsync_core's format, written and read with safetensors.

``zero`` saves and loads ``ZeroRedundancyOptimizer`` state at any world size (its ``save`` and
``load`` call it); ``model_state`` stores and loads model weights (not ZeRO's: any module);
``plain`` loads a checkpoint into an ordinary ``torch.optim`` optimizer; ``param_shards``
saves and loads a ``fully_shard``-ed model (ZeRO-3) and its optimizer in the same format;
``saved_keys`` checks the state keys a checkpoint holds against what the optimizer keeps;
``json_values`` turns hyper-parameters into manifest JSON and back; ``save_agreement`` is the
switching save's collectives on a process group (docs/design.md §9, docs/checkpoints.md).
"""

from gradsync_torch.checkpoint.model_state import load_model_weights
from gradsync_torch.checkpoint.param_shards import (
    load_fully_sharded as load_fully_sharded,  # deprecated alias of load_param_shards
)
from gradsync_torch.checkpoint.param_shards import (
    load_param_shards,
    save_param_shards,
)
from gradsync_torch.checkpoint.param_shards import (
    save_fully_sharded as save_fully_sharded,  # deprecated alias of save_param_shards
)
from gradsync_torch.checkpoint.plain import load_optimizer_state_dict

__all__: list[str] = [
    "load_model_weights",
    "load_optimizer_state_dict",
    "load_param_shards",
    "save_param_shards",
]
