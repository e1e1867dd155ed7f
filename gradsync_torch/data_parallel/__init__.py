"""Data parallelism: the ``DataParallel`` wrapper, its bucket ``Reducer`` and ZeRO-2's sharder.

- ``wrapper.py``: ``DataParallel`` decides *when* (hooks, ``no_sync``, the end of backward).
- ``setup.py``: its construction steps (groups, plan, cross-rank agreement, broadcast).
- ``reducer.py``: the ``Reducer`` owns every bucket and every gradient collective of a step.
- ``buckets.py``: the initial plan and the bucket buffers.
- ``used_map.py``: the per-sync CPU all-reduce of used flags; ``sync_agreement.py``: the
  runtime agreement record that rides in it; ``backward_sink.py``: the backward of a rank
  whose forward used no trainable parameter.
- ``grad_sharding.py``: ``GradientSharder`` (ZeRO-2's reducer) and ``pad_for_sharding``.
"""

from gradsync_torch.data_parallel.grad_sharding import GradientSharder, pad_for_sharding
from gradsync_torch.data_parallel.reducer import Reducer
from gradsync_torch.data_parallel.wrapper import DataParallel

__all__ = ["DataParallel", "GradientSharder", "Reducer", "pad_for_sharding"]
