"""The local optimizer's step, one sync job at a time (docs/torch-zero.md, "Parameter sync").

torch's ``ZeroRedundancyOptimizer`` steps all of a rank's parameters, then broadcasts them:
the link sits idle during the step and the CPU during the broadcasts. Stepping the
parameters of one broadcast job at a time, right before that job is sent, lets the backend
move the jobs already stepped (and receive the other owners' jobs) while the next ones are
stepped. This is exact only when the optimizer updates each tensor from that tensor's own
gradient and state, which holds for torch's built-in optimizers below: stepping a subset is
then the same arithmetic as stepping all of them, so results stay bitwise equal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim import Optimizer

from gradsync_torch.zero.broadcast import Job
from gradsync_torch.zero.options import ELEMENTWISE

# torch.optim classes whose step treats every tensor on its own. Adafactor's factored moments
# are per tensor too; LBFGS (one flat view of all parameters) and SparseAdam are not here.
PER_TENSOR = ELEMENTWISE | {"Adafactor"}


def steps_per_tensor(optimizer_class: type) -> bool:
    """Whether stepping a subset of ``optimizer_class``'s parameters at a time is exact."""
    is_torch = optimizer_class.__module__.startswith("torch.optim")
    return is_torch and optimizer_class.__name__ in PER_TENSOR


class JobStepper:
    """Steps ``optim``'s parameters job by job: ``stepper(job)`` steps exactly ``job.owned``.

    The per-group parameter lists of each job are computed once here, in the local
    optimizer's own order, so a step does no per-parameter Python work beyond torch's own.
    """

    def __init__(self, optim: Optimizer, jobs: list[Job]) -> None:
        self.optim = optim
        self.kwargs: dict[str, Any] = {}
        self._subsets: dict[int, list[list[torch.Tensor]]] = {}
        stepped: set[int] = set()
        for job in jobs:
            if not job.owned:
                continue
            wanted = {id(t) for t in job.owned}
            self._subsets[id(job)] = [
                [p for p in group["params"] if id(p) in wanted] for group in optim.param_groups
            ]
            stepped |= wanted
        local = [p for group in optim.param_groups for p in group["params"]]
        missing = [tuple(p.shape) for p in local if id(p) not in stepped]
        if missing:
            raise RuntimeError(
                f"internal error: {len(missing)} local parameter(s) (shapes {missing[:3]}) are in "
                "no sync job, so a step by jobs would skip them; please report this"
            )

    def __call__(self, job: Job) -> None:
        groups = self.optim.param_groups
        saved = [group["params"] for group in groups]
        try:
            for group, subset in zip(groups, self._subsets[id(job)], strict=True):
                group["params"] = subset
            self.optim.step(**self.kwargs)
        finally:
            for group, params in zip(groups, saved, strict=True):
                group["params"] = params
