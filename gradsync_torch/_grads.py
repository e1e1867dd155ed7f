"""What gradsync reduces: a dense gradient that is not part of a graph (docs/design.md §7).

One rule for every reducer of the torch executor (``DataParallel``'s buckets and the
shared-parameter sums), so the same mistake gets the same error type and sentence wherever
it is found.
"""

from __future__ import annotations

import torch


def check_grad(name: str, grad: torch.Tensor) -> None:
    """Raise unless ``grad`` (the gradient of parameter ``name``) can be reduced.

    Raises:
        RuntimeError: for a sparse gradient or one that requires grad.
    """
    if grad.layout != torch.strided:
        raise RuntimeError(
            f"parameter {name!r} has a {grad.layout} gradient of shape {tuple(grad.shape)}; "
            "gradsync reduces dense gradients only (use nn.Embedding(sparse=False))"
        )
    if grad.requires_grad:
        raise RuntimeError(
            f"the gradient of {name!r} requires grad (backward(create_graph=True)); "
            "gradsync cannot sync a gradient that is part of a graph: compute "
            "higher-order terms with torch.autograd.grad"
        )
