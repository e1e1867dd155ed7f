"""Checkpoints in torch: gradsync_core's format, written and read with safetensors.

ZeRO state at any world size, model weights, plain ``torch.optim`` optimizers, ``fully_shard``-ed
models, models laid out on any topology (``save_boxes``/``load_boxes``: across tp, cp, ep, pp and
dp) and the interchange with torch DCP, all in one format (docs/design.md §9,
docs/checkpoints.md).
"""

from gradsync_torch.checkpoint.boxes import Held, box_of, load_boxes, save_boxes
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
from gradsync_torch.checkpoint.preemption import PreemptionHandler

__all__: list[str] = [
    "Held",
    "PreemptionHandler",
    "box_of",
    "load_boxes",
    "load_model_weights",
    "load_optimizer_state_dict",
    "load_param_shards",
    "save_boxes",
    "save_param_shards",
]
