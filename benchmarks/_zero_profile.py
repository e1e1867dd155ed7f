"""Split a ZeRO optimizer's ``step()`` into local step, parameter sync and the rest.

``torch.distributed.optim.ZeroRedundancyOptimizer`` and gradsync's both keep this rank's local
optimizer in ``opt.optim``; after its ``step`` both make the replicas equal again (torch:
``opt._sync_params()``, broadcasts from each owner; gradsync: ``opt.layout.sync_params()``).
While a ``StepSplit`` is active those two calls are timed by wrapping them on the instance, and
``step()`` as a whole around them: rest = whole - local - sync is the wrapper's own bookkeeping
(hyper-parameter copies, ZeRO-2's gradient hand-over, re-planning checks). Used only by
``torch_zero.py --profile``, never during the timed rounds, so the wrapping costs them nothing.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

# Where each implementation keeps its parameter sync: (attribute path, method name).
SYNC_METHODS = ((("",), "_sync_params"), (("layout",), "sync_params"))


def _owner(obj: Any, path: tuple[str, ...]) -> Any:
    for name in path:
        if name:
            obj = getattr(obj, name, None)
    return obj


class StepSplit:
    """Times ``opt.step()`` and, where found, its local step and its parameter sync."""

    def __init__(self, opt: Any) -> None:
        self.opt = opt
        self.local_s: list[float] = []
        self.sync_s: list[float] = []
        self.whole_s: list[float] = []
        self._patched: list[tuple[Any, str, bool, Any]] = []
        self.has_local = self._wrap(getattr(opt, "optim", None), "step", self.local_s)
        self.has_sync = any(
            self._wrap(_owner(opt, path), method, self.sync_s) for path, method in SYNC_METHODS
        )

    def _wrap(self, owner: Any, method: str, sink: list[float]) -> bool:
        """Replace ``owner.method`` by a timed call on the instance; False if impossible."""
        original = getattr(owner, method, None) if owner is not None else None
        if not callable(original):
            return False

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                sink.append(time.perf_counter() - start)

        own = method in getattr(owner, "__dict__", {})
        try:
            setattr(owner, method, timed)
        except AttributeError:  # a __slots__ class: leave it untimed
            return False
        self._patched.append((owner, method, own, original))
        return True

    def step(self, sync_device: Callable[[], None] = lambda: None) -> None:
        """One timed ``opt.step()``; ``sync_device`` waits for queued kernels (CUDA)."""
        start = time.perf_counter()
        self.opt.step()
        sync_device()
        self.whole_s.append(time.perf_counter() - start)

    def medians(self) -> tuple[float, float, float, float]:
        """(whole, local, sync, rest) medians in seconds; NaN for a part not found."""
        whole = statistics.median(self.whole_s)
        local = statistics.median(self.local_s) if self.has_local else float("nan")
        sync = statistics.median(self.sync_s) if self.has_sync else float("nan")
        steps = len(self.whole_s)
        found = ((self.local_s, self.has_local), (self.sync_s, self.has_sync))
        parts = [times for times, present in found if present]
        if any(len(p) != steps for p in parts):  # not one call per step: subtract medians
            return whole, local, sync, whole - sum(statistics.median(p) for p in parts)
        rest = statistics.median(w - sum(p[i] for p in parts) for i, w in enumerate(self.whole_s))
        return whole, local, sync, rest

    def restore(self) -> None:
        """Put the original methods back."""
        for owner, method, own, original in reversed(self._patched):
            if own:
                setattr(owner, method, original)
            else:
                delattr(owner, method)
        self._patched.clear()
