"""Data parallelism: the ``DataParallel`` wrapper, its bucket ``Reducer`` and their collectives.

The ``Reducer`` owns every bucket and the backward; the wrapper decides when to sync; how one
bucket is reduced (all-reduce, comm hook, ZeRO-2's reduce-scatter) is a strategy the
``Reducer`` is given.
"""

from gradsync_torch.data_parallel.grad_sharding import ReduceScatter, pad_for_sharding
from gradsync_torch.data_parallel.options import DataParallelOptions
from gradsync_torch.data_parallel.reducer import Reducer
from gradsync_torch.data_parallel.sharded_grad import ShardedGradient
from gradsync_torch.data_parallel.wrapper import DataParallel

__all__ = [
    "DataParallel",
    "DataParallelOptions",
    "ReduceScatter",
    "Reducer",
    "ShardedGradient",
    "pad_for_sharding",
]
