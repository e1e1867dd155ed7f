"""Tensor/context-parallel building blocks for torch (docs/design.md §5, §6).

``groups`` turns a ``Topology`` into named process groups and sums shared-parameter
gradients over them; ``mappings`` holds the autograd collectives that cross a group
boundary; ``layers`` builds the column/row-parallel linears on top of both; ``experts`` the
mixture-of-experts block whose expert weights are reduced over ``edp``.
"""
