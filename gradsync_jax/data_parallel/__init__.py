"""Data parallelism in JAX: local gradients, their sync, accumulation and the training step.

Nothing here imports ``model_parallel``: the shared-parameter sums it runs after the mean
live one level up (``gradsync_jax.shared_reductions``).
"""

from gradsync_jax.data_parallel.accumulate import accumulate_local_grads, split_microbatches
from gradsync_jax.data_parallel.step import data_parallel_step
from gradsync_jax.data_parallel.sync import (
    local_grad,
    make_local,
    sync_gradients,
    value_and_local_grad,
)
from gradsync_jax.data_parallel.synced import SyncedState, synced

__all__: list[str] = [
    "SyncedState",
    "accumulate_local_grads",
    "data_parallel_step",
    "local_grad",
    "make_local",
    "split_microbatches",
    "sync_gradients",
    "synced",
    "value_and_local_grad",
]
