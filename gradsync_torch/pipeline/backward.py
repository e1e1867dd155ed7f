"""A stage's backward, whole or split, and its gradients summed in microbatch order.

The autograd calls are torch's (``torch.distributed.pipelining``, torch 2.13): a full backward
is one ``torch.autograd.backward`` from the stage's outputs (or the loss) into its inputs and
parameters; zero bubble's split runs torch's own ``stage_backward_input`` (the input
gradient, keeping the graph's intermediate gradients) and ``stage_backward_weight`` (the
weight gradient from them, later), and on the first stage, whose inputs need no gradient, the
weight half is the full backward. The same calls in the same order give the same bits.

Where the sums differ is the order: torch adds each microbatch's gradient into ``.grad`` in
the order its schedule runs the backwards, which for looped BFS is the reverse of the
microbatches. ``MicrobatchOrder`` adds them in microbatch order under every schedule
(docs/design.md §17): a microbatch whose backward runs early keeps its gradient aside until
the ones before it are in, so a change of schedule changes no bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch
from torch import nn

# torch's zero-bubble split, used as it is: its bits are what the split schedules compare to.
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight


def _with_grads(
    outputs: Sequence[torch.Tensor], grads: Sequence[torch.Tensor | None] | None
) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
    kept, kept_grads = [], []
    for i, out in enumerate(outputs):
        if not out.requires_grad and out.grad_fn is None:
            continue
        kept.append(out)
        kept_grads.append(None if grads is None else grads[i])
    return kept, kept_grads


def full_backward(
    outputs: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor | None] | None,
    inputs: Sequence[Any],
) -> tuple[torch.Tensor | None, ...]:
    """Input and weight gradients at once (torch's ``stage_backward``): the weights' into
    ``.grad``; returns the inputs' gradients (taken off the inputs)."""
    kept, kept_grads = _with_grads(outputs, grads)
    if kept:
        torch.autograd.backward(kept, grad_tensors=kept_grads)
    out: list[torch.Tensor | None] = []
    for value in inputs:
        if isinstance(value, torch.Tensor):
            out.append(value.grad)
            value.grad = None  # sent on: the gradient of an activation is not accumulated
        else:
            out.append(None)
    return tuple(out)


class SplitBackward:
    """Zero bubble's two halves for one (stage, microbatch): ``input_half`` now, whose result
    goes to the previous stage, ``weight_half`` later."""

    def __init__(
        self,
        module: nn.Module,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor | None] | None,
        inputs: Sequence[Any],
        *,
        first: bool,
    ) -> None:
        self.module, self.outputs, self.grads, self.inputs = module, outputs, grads, inputs
        self.first = first
        self.param_groups: list[dict[str, Any]] | None = None

    def input_half(self) -> tuple[torch.Tensor | None, ...]:
        """The inputs' gradients; the first stage has none to send and defers it all."""
        if self.first:
            return tuple(None for _ in self.inputs)
        outputs = list(self.outputs)
        # torch's runtime passes None for an output without a gradient; its annotation omits it
        grads = None if self.grads is None else cast(list[torch.Tensor], list(self.grads))
        dinputs, self.param_groups = stage_backward_input(
            outputs, grads, list(self.inputs), self.module.parameters()
        )
        for value in self.inputs:
            if isinstance(value, torch.Tensor):
                value.grad = None
        return tuple(dinputs)

    def weight_half(self) -> None:
        """The weights' gradients, into ``.grad``."""
        if self.first:
            full_backward(self.outputs, self.grads, self.inputs)
            return
        assert self.param_groups is not None
        stage_backward_weight(self.module.parameters(), self.param_groups)


class MicrobatchOrder:
    """Adds a stage's microbatch gradients into ``.grad`` in microbatch order.

    A backward of the next microbatch in order accumulates straight into ``.grad`` (torch's
    accumulation, bit for bit); one that comes early runs with ``.grad`` set aside, its
    gradient is held, and it is added once every microbatch before it is in.
    """

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        self.params = list(params)
        self.next = 0
        self.held: dict[int, list[torch.Tensor | None]] = {}

    def reset(self) -> None:
        self.next = 0
        self.held.clear()

    @property
    def holding(self) -> int:
        """Microbatch gradients held aside now."""
        return len(self.held)

    @contextmanager
    def microbatch(self, mb: int) -> Iterator[None]:
        """Run the backward that completes microbatch ``mb``'s weight gradient inside."""
        if mb == self.next:
            yield
            self.next += 1
            self._drain()
            return
        kept = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        try:
            yield
            self.held[mb] = [p.grad for p in self.params]
        finally:
            for p, grad in zip(self.params, kept, strict=True):
                p.grad = grad

    def _drain(self) -> None:
        while self.next in self.held:
            with torch.no_grad():
                for p, grad in zip(self.params, self.held.pop(self.next), strict=True):
                    if grad is None:
                        continue
                    if p.grad is None:
                        p.grad = grad
                    else:
                        p.grad += grad
            self.next += 1
