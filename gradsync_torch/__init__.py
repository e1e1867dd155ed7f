"""gradsync_torch: executes gradsync_core plans with torch."""

from gradsync_torch._comm_hooks import (
    GradBucket,
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from gradsync_torch._data_parallel import DataParallel

__all__: list[str] = [
    "DataParallel",
    "GradBucket",
    "allreduce_hook",
    "bf16_compress_hook",
    "fp16_compress_hook",
]
