"""``ZeroRedundancyOptimizer``'s options, their checks, and the ZeRO-2 link to ``DataParallel``.

The checks refuse a combination which cannot work; the link is to a sharding ``DataParallel``
(docs/torch-zero.md).

The optimizer rule is the core's (``gradsync_torch._optim_rules``; ``fully_shard`` applies the
same rule to its rows): ZeRO-2 steps elementwise optimizers only, and ZeRO-1 refuses a coupled
one (L-BFGS), which no rank can step a part of the model of.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.optim import Optimizer

from gradsync_core.plan import COUPLED
from gradsync_torch._optim_rules import elementwise_names, exact_path, is_elementwise, kind_of
from gradsync_torch.data_parallel import DataParallel, ReduceScatter


def check_elementwise(optimizer_class: type) -> None:
    """Raise ``ValueError`` unless ``optimizer_class`` is one of torch's elementwise ones
    (``gradsync_torch._optim_rules``, the rule ``fully_shard`` applies too)."""
    if not is_elementwise(optimizer_class):
        raise ValueError(
            f"gradient sharding (ZeRO-2) cuts parameters into element ranges, which is exact "
            f"only for elementwise optimizers ({elementwise_names()} from torch.optim); "
            f"{exact_path(optimizer_class, 'ranges')}"
            + (
                ", or use ZeRO-1 (shard_gradients=False), which shards whole parameters"
                if kind_of(optimizer_class) != COUPLED
                else ""
            )
        )


def check_not_coupled(optimizer_class: type) -> None:
    """Raise ``ValueError`` if ``optimizer_class`` couples every parameter (L-BFGS): each
    rank would step its own parameters with a search over those alone."""
    if kind_of(optimizer_class) == COUPLED:
        raise ValueError(
            "ZeroRedundancyOptimizer steps each rank's parameters with its own local "
            f"optimizer; {exact_path(optimizer_class, 'ranges')}"
        )


def check_options(
    optimizer_class: type,
    shard_gradients: bool,
    data_parallel: DataParallel | None,
    bucket_cap_mb: float,
    defaults: dict[str, Any],
) -> None:
    """Refuse ``ZeroRedundancyOptimizer`` options that cannot work, naming the fix (removes
    torch's ``overlap_with_ddp`` from ``defaults``, after refusing it when set).

    Raises:
        TypeError: if ``optimizer_class`` is not a torch optimizer class.
        ValueError: for a coupled optimizer (L-BFGS), a non-elementwise one with ZeRO-2,
            ``data_parallel`` without
            ZeRO-2, a non-positive bucket cap or ``overlap_with_ddp``.
        RuntimeError: if torch.distributed is not initialized.
    """
    if defaults.pop("overlap_with_ddp", False):
        raise ValueError(
            "overlap_with_ddp is not supported; pass shard_gradients=True to overlap "
            "gradient communication with the sharded step instead"
        )
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"optimizer_class must be a torch.optim.Optimizer subclass such as "
            f"torch.optim.Adam, got {optimizer_class!r}"
        )
    check_not_coupled(optimizer_class)
    if shard_gradients:
        check_elementwise(optimizer_class)
    elif data_parallel is not None:
        raise ValueError(
            "data_parallel= hands this optimizer DataParallel's gradient shards (ZeRO-2); "
            "pass shard_gradients=True with it, or leave data_parallel out for ZeRO-1"
        )
    if not dist.is_initialized():
        raise RuntimeError(
            "ZeroRedundancyOptimizer needs torch.distributed; call "
            "torch.distributed.init_process_group() first (world_size=1 works too)"
        )
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")


def claim_sharder(
    data_parallel: DataParallel | None, consumer: object, world_size: int
) -> ReduceScatter | None:
    """The gradient sharder of ``data_parallel``, checked and claimed by ``consumer`` (the
    optimizer that steps its shards), if ``data_parallel`` is given."""
    if data_parallel is None:
        return None
    sharder = data_parallel.gradient_sharder
    if sharder is None:
        raise ValueError(
            "data_parallel= was built without shard_gradients=True, so it all-reduces "
            "whole gradients; wrap the model as DataParallel(net, shard_gradients=True), "
            "or leave data_parallel out and this optimizer reduce-scatters in step()"
        )
    if sharder.world_size != world_size:
        raise ValueError(
            f"DataParallel shards gradients over {sharder.world_size} ranks, this "
            f"optimizer's process group has {world_size}; pass the same group"
        )
    sharder.claim(consumer)
    return sharder
