"""The ZeRO optimizer under torch's ``Join`` (uneven inputs; docs/torch-zero.md).

A rank that ran out of batches still owns its shard: every step the other ranks run, it must
step that shard and broadcast it, or they wait for it forever. Joined with the model
(``Join([model, zero])``, the ``DataParallel`` first), the model's hook has already shadowed the
backward, which leaves the averaged gradients in ``param.grad`` on this rank too
(``Reducer.shadow_sync``), so the shard steps with the same gradients as on every other rank:
unlike torch's ZeRO under DDP, whose joined rank steps with the gradients it had last.
"""

from __future__ import annotations

from typing import Any

from torch.distributed.algorithms.join import JoinHook


class ZeroJoinHook(JoinHook):
    """``main_hook``: one optimizer step per step of the ranks still running.

    Args:
        zero: the ``ZeroRedundancyOptimizer``.
    """

    def __init__(self, zero: Any) -> None:
        self.zero = zero
        super().__init__()

    def main_hook(self) -> None:
        """Step this rank's shard and broadcast it, as every other rank does."""
        self.zero.step()
