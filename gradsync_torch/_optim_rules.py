"""Which torch optimizers a sharding may step in pieces: the core's one rule, for torch classes.

``gradsync_core.plan``'s optimizer kinds (docs/matrix-optimizers.md) decide for ZeRO-1
(whole tensors), ZeRO-2 (element ranges of a bucket) and ZeRO-3 (``fully_shard``'s rows)
alike: an ``elementwise`` optimizer steps any piece; a ``per_tensor`` one (Muon orthogonalizes
each matrix, Adafactor factors its moments) steps whole tensors only, which
``gradsync_torch.MatrixOptimizer`` gives it under every sharding; a ``coupled`` one (L-BFGS)
no sharding at all; and an optimizer from outside ``torch.optim`` cannot be told apart, so it
is refused wherever a piece of a tensor would be stepped.
"""

from __future__ import annotations

from gradsync_core.plan import COUPLED, ELEMENTWISE, PER_TENSOR, optimizer_kind, optimizers_of_kind
from gradsync_torch._optim_state import optimizer_name

ELEMENTWISE_NAMES = frozenset(optimizers_of_kind(ELEMENTWISE, torch=True))


class StepsWholeTensors:
    """Marks an optimizer that gathers every tensor whole before stepping it
    (``MatrixOptimizer``): the row-shard check of ``fully_shard`` lets it step."""


def kind_of(optimizer_class: type) -> str:
    """The core's kind of ``optimizer_class``: ``elementwise``, ``per_tensor``, ``coupled``
    or ``unknown`` (any class not torch.optim's own).

    Example:
        >>> import torch
        >>> kind_of(torch.optim.AdamW), kind_of(torch.optim.Muon), kind_of(torch.optim.LBFGS)
        ('elementwise', 'per_tensor', 'coupled')
    """
    return optimizer_kind(optimizer_name(optimizer_class))


def is_elementwise(optimizer_class: type) -> bool:
    """Whether ``optimizer_class`` is one of torch's elementwise optimizers.

    Example:
        >>> import torch
        >>> is_elementwise(torch.optim.AdamW), is_elementwise(torch.optim.Adafactor)
        (True, False)
    """
    return kind_of(optimizer_class) == ELEMENTWISE


def elementwise_names() -> str:
    """The elementwise optimizers as the sentences list them: sorted, comma-separated."""
    return ", ".join(sorted(ELEMENTWISE_NAMES))


def qualified_name(optimizer_class: type) -> str:
    """``module.Class``, as the sentences name an optimizer."""
    return f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"


# How MatrixOptimizer runs a per-tensor optimizer for each sharding a refusal names.
_PATHS = {
    "rows": (
        "MatrixOptimizer({name}(matrices, ...))",
        "steps each matrix whole on one planned owner and hands every rank back its rows",
    ),
    "ranges": (
        "MatrixOptimizer({name}(matrices, ...), shard_gradients=True)",
        "reduces each matrix's gradient to one planned owner only, steps it there whole and "
        "broadcasts it",
    ),
}


def exact_path(optimizer_class: type, sharding: str) -> str:
    """The end of a refusal of ``optimizer_class`` under ``sharding`` (``"rows"``: ZeRO-3,
    ``"ranges"``: ZeRO-2): the exact way to run it where one exists, else what to use."""
    kind = kind_of(optimizer_class)
    name = qualified_name(optimizer_class)
    if kind == PER_TENSOR:
        call, how = _PATHS[sharding]
        return (
            f"{name} reads each whole tensor, so run it exactly as "
            f"gradsync_torch.{call.format(name=optimizer_class.__name__)}, which {how}, and "
            "give the other parameters to an elementwise optimizer (docs/matrix-optimizers.md)"
        )
    if kind == COUPLED:
        return (
            f"{name} reads every parameter at once (a line search over the whole model), so "
            "no rank can step a part of the model: keep it replicated (DataParallel without "
            "ZeRO) or use an elementwise optimizer"
        )
    return (
        f"{name} may read a whole tensor or several, so its step would differ from one "
        "process: use an elementwise optimizer"
    )
