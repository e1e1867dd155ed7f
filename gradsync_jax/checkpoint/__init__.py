"""Checkpoints in JAX: gradsync_core's format, written and read with safetensors and NumPy.

``zero`` saves and loads ``shard_optimizer`` (or plain Optax) state in the framework-neutral
format; ``model_state`` stores and loads model weights (not ZeRO's: any parameter tree);
``processes`` is the switching save's collectives over ``jax.distributed`` processes and the
host views a save works from, and the agreement that ends a load read in parts; ``stored``
locates model-space tensors in the rank files by their headers and reads the element ranges
a load keeps; ``safetensors_io`` reads headers and element ranges (bfloat16 and float8
included); ``param_shards`` saves and loads ZeRO-3 (each process reads only its devices'
rows); ``optimizers`` maps Optax
state types to gradsync_core's canonical optimizer names (docs/design.md §9,
docs/checkpoints.md).
"""

from gradsync_jax.checkpoint.model_state import load_params
from gradsync_jax.checkpoint.zero import load_optimizer_state, save_optimizer_state

__all__: list[str] = ["load_optimizer_state", "load_params", "save_optimizer_state"]
