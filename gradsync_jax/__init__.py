"""gradsync_jax: executes gradsync_core plans with jax."""

from gradsync_jax._accumulate import accumulate_local_grads, split_microbatches
from gradsync_jax._mesh import mesh_from_topology
from gradsync_jax._step import data_parallel_step
from gradsync_jax._sync import local_grad, make_local, sync_gradients, value_and_local_grad

__all__: list[str] = [
    "accumulate_local_grads",
    "data_parallel_step",
    "local_grad",
    "make_local",
    "mesh_from_topology",
    "split_microbatches",
    "sync_gradients",
    "value_and_local_grad",
]
