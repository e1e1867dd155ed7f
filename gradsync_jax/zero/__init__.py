"""Sharded Optax (ZeRO for JAX): ``shard_optimizer`` and its state (docs/design.md §4).

Its checkpoints live in ``gradsync_jax.checkpoint``."""

from gradsync_jax.zero.clip import clip_by_global_norm, global_norm_args
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
    "global_norm_args",
    "shard_optimizer",
]
