"""Optimizers on ``fully_shard``'s rows: ZeRO-2's elementwise rule, at the first step.

See docs/torch-zero3.md, "Optimizers".

Each rank steps its own rows of every parameter, so an optimizer gives the unsharded result
only if it is elementwise (``gradsync_torch._optim_rules``). ``torch.optim.Muon`` is not: it
orthogonalizes each rank's rows instead of the matrix (a 16-32-8 MLP at 2 ranks differed from
one process by 1.9e-3 after 2 steps); its refusal names the exact way,
``gradsync_torch.MatrixOptimizer``, which steps each matrix whole on one owner (and is let
through here: it never steps rows). FSDP2 has no optimizer wrapper, and neither has
gradsync's ``fully_shard``: the user builds ``torch.optim.X(model.parameters())`` on the
sharded parameters, so the optimizer is visible only when it steps. torch's one public place
for that is a global step pre-hook (``register_optimizer_step_pre_hook``), which runs before
any parameter or state changes; ``fully_shard`` registers it once per process. It costs one
set lookup per step for an elementwise optimizer, and reads the parameters of any other (it
refuses those holding rows ``fully_shard`` cut over more than one rank, and lets the rest
step).
"""

from __future__ import annotations

from typing import Any

from torch.optim import Optimizer
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

from gradsync_torch._optim_rules import (
    StepsWholeTensors,
    elementwise_names,
    exact_path,
    is_elementwise,
)
from gradsync_torch.param_sharding._unit import ROWS

_HANDLE: list[RemovableHandle] = []  # the one registration in this process


def refuse_non_elementwise() -> None:
    """Register the step pre-hook that refuses a non-elementwise optimizer on ``fully_shard``'s
    rows (once per process; later calls do nothing)."""
    if not _HANDLE:
        _HANDLE.append(register_optimizer_step_pre_hook(check_optimizer))


def check_optimizer(optimizer: Optimizer, args: Any = (), kwargs: Any = None) -> None:
    """Raise ``ValueError`` if ``optimizer`` is not elementwise and steps parameters that
    ``fully_shard`` cut into rows over more than one rank.

    Raises:
        ValueError: naming the optimizer, the elementwise ones and the alternative.
    """
    cls = type(optimizer)
    if is_elementwise(cls) or isinstance(optimizer, StepsWholeTensors):
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            rows = getattr(param, ROWS, None)
            if rows is not None and rows.shard_size > 1:
                raise ValueError(
                    f"{rows.owner} cut this optimizer's parameters into rows over "
                    f"{rows.shard_size} ranks, and stepping each rank's rows alone is exact only "
                    f"for elementwise optimizers ({elementwise_names()} from torch.optim); "
                    f"{exact_path(cls, 'rows')}"
                )
