"""Peak gradient memory of one rank during a backward and step, measured from live tensors.

``torch_zero.py`` samples, after every gradient's hand-over to the wrapper (a
``register_post_accumulate_grad_hook`` registered after the wrapper's own) and once after the
backward, the bytes of the distinct storages that hold gradients then: every ``param.grad``,
gradsync ``DataParallel``'s bucket buffers (and wire buffers), and the ZeRO-2 gradient shards.
Storages are counted once however many views share them, and only while they exist, so the
figure is what was allocated, not what the sizes say. Not seen: DDP's bucket buffers (inside
its C++ reducer) and a gradient between autograd creating it and the wrapper's hook taking it
(at most one parameter's gradient on top).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from gradsync_torch import DataParallel


def _buffers_of(model: nn.Module) -> Callable[[], Iterable[torch.Tensor]]:
    """The gradient buffers gradsync's ``DataParallel`` holds now (none for DDP)."""
    if not isinstance(model, DataParallel):
        return lambda: ()
    # Bucket and wire buffers, or ZeRO-2's pool and shards.
    return model.reducer.buffer_tensors


class GradMemory:
    """Records the peak of gradient-holding storage bytes while ``active``."""

    def __init__(self, model: nn.Module, params: Iterable[nn.Parameter]) -> None:
        self.params = list(params)
        self.buffers = _buffers_of(model)
        self.active = False
        self.peak = 0
        for p in self.params:
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._on_grad)

    def _on_grad(self, _: torch.Tensor) -> None:
        if self.active:
            self.sample()

    def sample(self) -> None:
        storages: dict[int, int] = {}
        # A ZeRO-2 placeholder (ShardedGradient) holds no storage: its gradient is a shard.
        tensors = [p.grad for p in self.params if type(p.grad) is torch.Tensor]
        for t in [*tensors, *self.buffers()]:
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        self.peak = max(self.peak, sum(storages.values()))
