"""Tensor/context/expert-parallel building blocks for torch (docs/design.md §5, §6).

The process groups they take live one level up (``gradsync_torch.groups``), as do the
shared-parameter sums (``gradsync_torch.shared_reductions``) and the sharding declarations
they read (``gradsync_torch._specs``).
"""
