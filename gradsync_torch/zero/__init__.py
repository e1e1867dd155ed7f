"""ZeRO for torch: optimizer state (ZeRO-1) and gradients (ZeRO-2) sharded over data-parallel
ranks, with checkpoints that load at any world size (docs/design.md §9).

``optimizer`` holds ``ZeroRedundancyOptimizer``; ``plans`` decides which rank owns what;
``options`` checks its options; ``layout`` (the protocol), ``greedy`` (ZeRO-1) and ``flat``
(ZeRO-2) say where state lives and how parameters travel, through ``broadcast``; ``state``
moves state between layouts. Checkpoints (of ZeRO state and of model weights) live in
``gradsync_torch.checkpoint``.
"""

from gradsync_torch.zero.optimizer import ZeroRedundancyOptimizer

__all__: list[str] = ["ZeroRedundancyOptimizer"]
