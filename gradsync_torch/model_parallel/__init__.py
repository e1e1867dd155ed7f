"""Tensor/context/expert-parallel building blocks for torch (docs/design.md §5, §6).

``mappings`` holds the autograd collectives that cross a group boundary; ``layers`` builds the
column/row-parallel linears on top of them; ``experts`` the mixture-of-experts block whose
expert weights are reduced over ``edp``. The process groups they take live one level up
(``gradsync_torch.groups``), as do the shared-parameter sums (``gradsync_torch.shared_reductions``)
and the sharding declarations they read (``gradsync_torch._specs``).
"""
