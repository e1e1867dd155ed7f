"""Pipeline parallelism in one SPMD program: a ``PipelinePlan`` run by ``shard_map``.

See docs/pipeline.md, "The JAX executor".
"""

from gradsync_jax.pipeline.checkpoint import load_pipeline, save_pipeline
from gradsync_jax.pipeline.flax_models import linen_model, nnx_model, nnx_state
from gradsync_jax.pipeline.layout import (
    natural_params,
    pipeline_layout,
    pipeline_params,
    pipeline_specs,
    sequential_params,
    stacked_params,
)
from gradsync_jax.pipeline.loop import run_pipeline
from gradsync_jax.pipeline.model import PipelineModel
from gradsync_jax.pipeline.step import PipelineStep, pipeline_step
from gradsync_jax.pipeline.ticks import TickProgram, compile_ticks

__all__: list[str] = [
    "PipelineModel",
    "PipelineStep",
    "TickProgram",
    "compile_ticks",
    "linen_model",
    "load_pipeline",
    "natural_params",
    "nnx_model",
    "nnx_state",
    "pipeline_layout",
    "pipeline_params",
    "pipeline_specs",
    "pipeline_step",
    "run_pipeline",
    "save_pipeline",
    "sequential_params",
    "stacked_params",
]
