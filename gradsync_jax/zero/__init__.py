"""Sharded Optax (ZeRO for JAX): ``shard_optimizer``, its state, checkpoints (docs/design.md §4)."""

from gradsync_jax.zero.checkpoint import load_optimizer_state, save_optimizer_state
from gradsync_jax.zero.clip import clip_by_global_norm
from gradsync_jax.zero.flat import NotElementwiseError
from gradsync_jax.zero.layout import Layout, ZeroState
from gradsync_jax.zero.transform import ShardedOptimizer, ZeroSettings, shard_optimizer

__all__: list[str] = [
    "Layout",
    "NotElementwiseError",
    "ShardedOptimizer",
    "ZeroSettings",
    "ZeroState",
    "clip_by_global_norm",
    "load_optimizer_state",
    "save_optimizer_state",
    "shard_optimizer",
]
