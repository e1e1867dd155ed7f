"""Checkpoints in JAX: gradsync_core's format, written and read with safetensors and NumPy.

Saves and loads ``shard_optimizer`` (or plain Optax) state, model weights and ZeRO-3 training
state in the framework-neutral format (docs/design.md §9, docs/checkpoints.md).
"""

from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.zero import load_optimizer_state, save_optimizer_state

__all__: list[str] = ["load_optimizer_state", "load_params", "save_optimizer_state"]
