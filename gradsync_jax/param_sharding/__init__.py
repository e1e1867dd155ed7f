"""Sharded parameters for JAX (ZeRO-3) from the plan torch's FSDP2 executes (docs/jax-zero3.md)."""

from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout, param_layout
from gradsync_jax.param_sharding.options import Zero3Options
from gradsync_jax.param_sharding.placement import shard_params, unshard_params
from gradsync_jax.param_sharding.policy import MixedPrecisionPolicy
from gradsync_jax.param_sharding.step import Zero3Step, zero3_step

__all__: list[str] = [
    "LeafLayout",
    "MixedPrecisionPolicy",
    "ParamLayout",
    "Zero3Options",
    "Zero3Step",
    "param_layout",
    "shard_params",
    "unshard_params",
    "zero3_step",
]
