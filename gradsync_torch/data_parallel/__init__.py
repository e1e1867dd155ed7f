"""Data parallelism: the ``DataParallel`` wrapper, its bucket ``Reducer`` and the bucket
collectives it is given (all-reduce, comm hook, ZeRO-2's reduce-scatter).

- ``wrapper.py``: ``DataParallel``: the forward and the user's verbs (``no_sync``,
  ``register_comm_hook``, ``sync_gradients``).
- ``options.py``: the options every rank must agree on (``DataParallelOptions``) and the
  argument checks; ``setup.py``: the construction steps (parameters, groups, plan, cross-rank
  agreement, broadcast).
- ``reducer.py``: the ``Reducer`` owns every bucket and the backward; ``readiness.py``: its
  gradient hooks, one Python frame per bucket; ``bucket_collectives.py``: how one bucket is
  reduced (``AllReduce``, ``CommHook``); ``grad_sharding.py``: ZeRO-2's ``ReduceScatter`` and
  ``pad_for_sharding``; ``sharded_grad.py``: ``ShardedGradient``, what ``param.grad`` holds
  after a ZeRO-2 sync.
- ``buckets.py``: the initial plan and the bucket buffers.
- ``used_map.py``: the per-sync CPU all-reduce of used flags; ``sync_agreement.py``: the
  runtime agreement record that rides in it; ``backward_sink.py``: the backward of a rank
  whose forward used no trainable parameter.
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
