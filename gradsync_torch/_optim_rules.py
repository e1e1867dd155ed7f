"""Which torch optimizers may step a piece of a tensor (ZeRO-2's ranges, ZeRO-3's rows).

The one rule ZeRO-2 (element ranges of a bucket) and ZeRO-3 (``fully_shard``'s rows) both
apply (docs/torch-zero.md, docs/torch-zero3.md).

An optimizer that steps each rank's piece alone gives the unsharded result only if its update
of one element reads only that element's gradient and state (plus per-tensor scalars such as
the step count). torch's elementwise optimizers do; Muon (it orthogonalizes the whole matrix),
Adafactor (factored moments), LBFGS (a line search over every parameter) and SparseAdam do not,
and an optimizer from outside ``torch.optim`` cannot be told apart, so it is refused too.
"""

from __future__ import annotations

ELEMENTWISE = frozenset(
    {
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "NAdam",
        "RAdam",
        "RMSprop",
        "Adagrad",
        "Adadelta",
        "Rprop",
        "ASGD",
    }
)


def is_elementwise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` is one of torch's elementwise optimizers (``ELEMENTWISE``).

    Example:
        >>> import torch
        >>> is_elementwise(torch.optim.AdamW), is_elementwise(torch.optim.Adafactor)
        (True, False)
    """
    is_torch = optimizer_class.__module__.startswith("torch.optim")
    return is_torch and optimizer_class.__name__ in ELEMENTWISE


def elementwise_names() -> str:
    """``ELEMENTWISE`` as the sentences list it: sorted, comma-separated."""
    return ", ".join(sorted(ELEMENTWISE))


def qualified_name(optimizer_class: type) -> str:
    """``module.Class``, as the sentences name an optimizer."""
    return f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
