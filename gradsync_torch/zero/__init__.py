"""ZeRO for torch: optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded over ranks.

Checkpoints load at any world size (docs/design.md §9); they (ZeRO state and model weights)
live in ``gradsync_torch.checkpoint``.
"""

from gradsync_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__: list[str] = ["ZeroRedundancyOptimizer"]
