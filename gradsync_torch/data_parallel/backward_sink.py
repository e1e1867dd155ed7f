"""Let a rank whose forward used no trainable parameter still run a backward and sync.

``DataParallel`` learns that a backward reached the model from hooks on its outputs and
on one parameter per bucket. A rank whose forward touched no trainable parameter (a batch
routed around every layer, an empty batch) has no output that requires grad, so
``loss.backward()`` raises, while the other ranks wait for it in their first bucket (DDP
hangs here too). gradsync instead passes such an output through ``BackwardSink``: the copies
require grad (through a zero-dimensional anchor that receives no gradient), and the sink's
backward tells the wrapper that a backward ran, so the rank joins the sync with zeros at the
same point as the others, like a rank with only some parameters unused.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree


class BackwardSink(torch.autograd.Function):
    """Identity on ``outputs`` whose backward calls ``notify()`` first."""

    @staticmethod
    def forward(
        ctx: Any, notify: Callable[[], None], anchor: torch.Tensor, *outputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.notify = notify
        return tuple(t.clone() for t in outputs)  # an autograd output must be a new tensor

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.notify()
        return (None, None, *grads)


def watch_backward(
    output: Any,
    anchor: torch.Tensor,
    notify: Callable[[], None],
    watch: Callable[[list[torch.Tensor]], None],
    *,
    sink: bool,
) -> Any:
    """Let a backward from ``output`` reach the wrapper.

    ``watch(tensors)`` is given the tensors of ``output`` that require grad (the Reducer
    hooks them); if none does and ``sink``, the floating-point tensors are passed through
    ``BackwardSink`` instead, so a backward from them reaches ``notify``. Returns ``output``
    or its copy through the sink.
    """
    leaves, spec = pytree.tree_flatten(output)
    tensors = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    grads = [leaves[i] for i in tensors if leaves[i].requires_grad]
    if grads:
        watch(grads)
        return output
    floating = [i for i in tensors if leaves[i].is_floating_point()]
    if not sink or not floating:
        return output  # nothing a loss could be computed from
    copies = BackwardSink.apply(notify, anchor, *(leaves[i] for i in floating))
    for i, copy in zip(floating, copies, strict=True):
        leaves[i] = copy
    return pytree.tree_unflatten(leaves, spec)
