"""Pipeline parallelism: a ``gradsync_core`` pipeline plan run on torch (docs/pipeline.md).

``split_model`` cuts a model's chain of blocks into the plan's stage modules; ``Pipeline``
runs this rank's actions of the plan on them; ``save_pipeline``/``load_pipeline`` write and
read its checkpoint in model space.
"""

from gradsync_torch.pipeline.checkpoint import load_pipeline, save_pipeline
from gradsync_torch.pipeline.runtime import Pipeline
from gradsync_torch.pipeline.stages import StageModule, StageSplit, split_model

__all__: list[str] = [
    "Pipeline",
    "StageModule",
    "StageSplit",
    "load_pipeline",
    "save_pipeline",
    "split_model",
]
