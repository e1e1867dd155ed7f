"""Checkpoints in JAX: gradsync_core's format, written and read with safetensors and NumPy.

Saves and loads ``shard_optimizer`` (or plain Optax) state, model weights, ZeRO-3 training
state and training states laid out on a mesh (``save_boxes``/``load_boxes``: across layouts)
in the framework-neutral format (docs/design.md §9, docs/checkpoints.md).
"""

from gradsync_jax.checkpoint.boxes import load_boxes, save_boxes
from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.preemption import PreemptionHandler
from gradsync_jax.checkpoint.zero import load_optimizer_state, save_optimizer_state

__all__: list[str] = [
    "PreemptionHandler",
    "load_boxes",
    "load_optimizer_state",
    "load_params",
    "save_boxes",
    "save_optimizer_state",
]
