"""Per-bucket readiness: which gradients arrived in a backward, for one Python frame per bucket.

Every trainable parameter gets a post-accumulate-grad hook. All but one per bucket are the
C-level ``list.append`` of the arrivals list, which runs no Python frame; the one on the
slot expected to arrive last in the bucket (its *flush* slot: its last slot in plan order,
since DDP's layout and the rebuilt one follow the ready order) is the Python ``_flush``,
which lets the owner take every arrival since the last flush at once and launch what is
complete. A bucket that completes on another slot (it waited for a later flush, or for the
end of backward) moves its flush hook there for the next backward (``repick_flush``).

The owner (the ``Reducer``) does the bucket accounting; this file knows the hooks, not the
buckets' buffers. The hooks hold the owner weakly, so a dropped wrapper's hooks are removed
instead of syncing twice. A backward that reaches none of the flush parameters still ends
in a sync: the wrapper's outputs carry a tensor hook (``watch_outputs``) that tells the
owner the backward reached the model.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from gradsync_torch.data_parallel.buckets import BucketBuffers


class ReadinessOwner(Protocol):
    """What the hooks call on the object that owns the buckets (the ``Reducer``)."""

    readiness: BucketReadiness

    def backward_reached(self) -> None:
        """A backward reached the model: queue its end."""

    def take_arrivals(self) -> None:
        """Account for every gradient that arrived since the last call."""


def _flush(owner: weakref.ref, param: torch.Tensor) -> None:
    """A bucket's flush parameter has its gradient accumulated.

    The one Python frame per bucket: every other parameter's hook only appended itself to
    the arrivals, so this takes all of them at once (the owner's ``take_arrivals``).
    """
    reducer = owner()
    if reducer is None:
        return
    reducer.readiness.arrivals.append(param)
    reducer.backward_reached()
    reducer.take_arrivals()


def _output_reached(owner: weakref.ref, grad: torch.Tensor) -> None:
    """A backward reached one of the wrapper's outputs (a tensor hook, one per output)."""
    reducer = owner()
    if reducer is not None and reducer.readiness.will_reach_params():
        reducer.backward_reached()


def _reached(owner: weakref.ref) -> None:
    reducer = owner()
    if reducer is not None:
        reducer.backward_reached()


def _remove_hooks(handles: dict[int, Any]) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()


class BucketReadiness:
    """The gradient hooks of one owner's parameters and the arrivals they record.

    Args:
        params: the trainable parameters; a parameter's position is its *slot*.
        owner: the ``ReadinessOwner`` the hooks call, held weakly.
    """

    def __init__(self, params: Sequence[torch.Tensor], owner: ReadinessOwner) -> None:
        self._params = list(params)
        self._owner = weakref.ref(owner)
        # The parameters whose gradients arrived, in order, appended by the hooks; ``_taken``
        # of them are accounted for.
        self.arrivals: list[torch.Tensor] = []
        self._taken = 0
        self._slot_of_id = {id(p): i for i, p in enumerate(self._params)}
        self._handles: dict[int, Any] = {}  # slot -> its hook
        self.flush_slots: list[int] = []  # per bucket, the slot whose hook is the flush
        self._repick: list[tuple[int, int]] = []  # (bucket, slot that completed it)
        self._grad_nodes: list[Any] | None = None
        weakref.finalize(self, _remove_hooks, self._handles)
        self.reached = functools.partial(_reached, self._owner)
        """``owner.backward_reached`` holding the owner weakly, for a ``BackwardSink``."""
        self._output_hook = functools.partial(_output_reached, self._owner)

    def install(self, buckets: Sequence[BucketBuffers]) -> None:
        """Hook every parameter for ``buckets``: the flush on each bucket's last slot, the
        C-level append everywhere else."""
        _remove_hooks(self._handles)
        self._repick = []
        self.flush_slots = [bucket.slot_ids[-1] for bucket in buckets]
        flush = set(self.flush_slots)
        for slot, p in enumerate(self._params):
            self._hook(slot, p, flush=slot in flush)

    def _hook(self, slot: int, param: torch.Tensor, *, flush: bool) -> None:
        old = self._handles.pop(slot, None)
        if old is not None:
            old.remove()
        fn = functools.partial(_flush, self._owner) if flush else self.arrivals.append
        self._handles[slot] = param.register_post_accumulate_grad_hook(fn)

    def take(self) -> list[int]:
        """The slots whose gradients arrived since the last call, in arrival order."""
        arrivals = self.arrivals
        if self._taken == len(arrivals):
            return []
        new = arrivals[self._taken :]
        self._taken = len(arrivals)
        slot_of = self._slot_of_id
        return [slot_of[id(p)] for p in new]

    def completed(self, bucket: int, slot: int) -> None:
        """Bucket ``bucket`` completed when ``slot`` arrived: if that is not its flush slot,
        flush on ``slot`` from the next backward on (``repick_flush``)."""
        if slot != self.flush_slots[bucket]:
            self._repick.append((bucket, slot))

    def repick_flush(self) -> None:
        """Move the flush hook of every bucket that completed on another slot."""
        for index, slot in self._repick:
            old = self.flush_slots[index]
            if old != slot:
                self.flush_slots[index] = slot
                self._hook(old, self._params[old], flush=False)
                self._hook(slot, self._params[slot], flush=True)
        self._repick = []

    def forget(self) -> None:
        """Start the next backward with no arrivals."""
        self.arrivals.clear()
        self._taken = 0

    def abandon(self) -> list[int]:
        """A backward raised before it finished: keep every flush hook where it is and
        return the slots whose gradients arrived in it (taken or not)."""
        self._repick = []
        slot_of = self._slot_of_id
        return [slot_of[id(p)] for p in self.arrivals]

    def will_reach_params(self) -> bool:
        """Inside a backward: whether it will accumulate a gradient into any parameter (not,
        say, ``torch.autograd.grad`` with respect to the inputs)."""
        return any(map(torch._C._will_engine_execute_node, self._grad_nodes or ()))

    def watch_outputs(self, tensors: Sequence[torch.Tensor]) -> None:
        """Learn that a backward reached the model from its outputs too (``tensors``: those
        that require grad), so a backward whose flush parameters are all unused still syncs."""
        if self._grad_nodes is None:  # each parameter's AccumulateGrad node, found once
            self._grad_nodes = [_accumulate_grad(p) for p in self._params]
        for t in tensors:
            t.register_hook(self._output_hook)


def _accumulate_grad(param: torch.Tensor) -> Any:
    """The AccumulateGrad node of a parameter that requires grad."""
    node = param.view_as(param).grad_fn
    assert node is not None  # a view of a tensor that requires grad has a grad_fn
    return node.next_functions[0][0]
