"""Checkpoints in torch: gradsync_core's format, written and read with safetensors.

ZeRO state at any world size, model weights, plain ``torch.optim`` optimizers, ``fully_shard``-ed
models and the interchange with torch DCP, all in one format (docs/design.md §9,
docs/checkpoints.md).
"""

from gradsync_torch.checkpoint.model_state import load_model_weights
from gradsync_torch.checkpoint.param_shards import load_fully_sharded, save_fully_sharded
from gradsync_torch.checkpoint.plain import load_optimizer_state_dict

__all__: list[str] = [
    "load_fully_sharded",
    "load_model_weights",
    "load_optimizer_state_dict",
    "save_fully_sharded",
]
