"""Save before a scheduler's kill, in torch.

``gradsync_core``'s ``PreemptionHandler`` whose step-boundary exchange is an all-gather of
``[signalled, step]`` over a process group.

The exchange runs in the training loop's thread, between steps, on the training group itself:
in the same order on every rank as training's collectives, so it needs no group of its own
(unlike a save's background agreement, gradsync_torch/checkpoint/save_agreement.py).
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core.checkpoint import PREEMPTED_EXIT
from gradsync_core.checkpoint import PreemptionHandler as _CorePreemptionHandler
from gradsync_torch._collectives import all_gather_single
from gradsync_torch.agreement import _digest_device


class PreemptionHandler(_CorePreemptionHandler):
    """On SIGTERM, every rank of ``group`` saves at the same step boundary and exits with
    status 143 (docs/checkpoints.md, "Preemption").

    Args:
        group: the ranks that train together (``None``: the world).
        signals: the signals that ask for a save (default SIGTERM, what schedulers send).
        exit_code: the status ``exit()`` ends the process with (``PREEMPTED_EXIT``, 143).

    Example:
        >>> with PreemptionHandler() as preemption:  # doctest: +SKIP
        ...     for step in range(steps):
        ...         train_step()
        ...         if preemption.should_save(step):
        ...             opt.save(path, model=net, blocking=False)
        ...             preemption.exit()
    """

    def __init__(
        self,
        group: Any = None,
        *,
        signals: Sequence[int] = (signal.SIGTERM,),
        exit_code: int = PREEMPTED_EXIT,
    ) -> None:
        super().__init__(self._gather, signals=signals, exit_code=exit_code)
        self.group = group

    def _gather(self, mine: list[int]) -> list[list[int]]:
        if not dist.is_initialized() or dist.get_world_size(self.group) == 1:
            return [mine]
        device = _digest_device(self.group)
        size = dist.get_world_size(self.group)
        out = torch.empty(size * len(mine), dtype=torch.int64, device=device)
        all_gather_single(
            out, torch.tensor(mine, dtype=torch.int64, device=device), group=self.group
        )
        return out.view(size, -1).cpu().tolist()
