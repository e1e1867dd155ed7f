"""Shared-parameter gradient sums: a ``ReductionPlan`` executed over ``ProcessGroups``.

See docs/design.md §6.

A parameter replicated over a model-parallel axis (a norm under tensor or context
parallelism) gets a partial gradient on each member of that axis; the plan's buckets sum them
over the axis' group. Expert weights (the plan's ``"edp"`` reduction) are summed over ``edp``
and divided by the dense ``dp`` instead of joining the dense data-parallel mean.

``check_reduction_plan`` agrees on the plan across ranks (``agreement.agree_on``: digests,
the detail only on a mismatch); ``SharedReducer`` runs it every step from buffers allocated
once; ``reduce_shared_gradients`` is the one-call form for a training loop of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import BucketPlan, ReductionPlan, describe_difference
from gradsync_torch._grads import check_grad
from gradsync_torch._specs import named_parameters
from gradsync_torch.agreement import Disagreement, agree_on
from gradsync_torch.groups import ProcessGroups


def _check_topology(plan: ReductionPlan, groups: ProcessGroups) -> None:
    if plan.topology != groups.topology:
        raise ValueError(
            "the reduction plan was made for another topology; build it with "
            "plan_shared_reductions(specs, groups.topology)"
        )


def check_reduction_plan(plan: ReductionPlan, groups: ProcessGroups) -> None:
    """Verify that every member of each reduction group holds the same buckets (collective).

    Digests through ``agree_on``, run once at setup: first the list of groups over the world
    (a rank missing a group would otherwise leave its peers waiting in that group's check),
    then each group's buckets over the group. A mismatch raises the same error on every rank
    concerned, naming the ranks and the first differing parameter, instead of hanging later.

    Raises:
        ValueError: if the plan's topology is not ``groups.topology`` or members differ.
    """
    _check_topology(plan, groups)
    agree_on(
        list(plan.group_names),
        None,
        describe=lambda d: (
            f"rank {d.base_rank} plans extra sums over {list(d.base)} but rank "
            f"{d.other_rank} over {list(d.other)}; build the plan from the same model on "
            "every rank"
        ),
    )
    for reduction in plan.reductions:
        group = groups.group(reduction.group)
        if group.size == 1:
            continue
        agree_on(
            reduction.buckets.to_json(),
            group.process_group,
            describe=functools.partial(_describe_buckets, reduction.group),
        )


def _describe_buckets(name: str, d: Disagreement) -> str:
    difference = describe_difference(BucketPlan.from_json(d.base), BucketPlan.from_json(d.other))
    return (
        f"ranks {d.base_rank} and {d.other_rank} of group {name!r} hold different "
        f"shared-reduction buckets: {difference}; build the plan from the same model on every "
        "rank"
    )


class _Bucket(NamedTuple):
    """One bucket of one reduction, bound to its parameters and its persistent buffer."""

    flat: torch.Tensor
    params: tuple[tuple[str, torch.Tensor, torch.Tensor], ...]  # (name, param, view of flat)
    group: dist.ProcessGroup
    divisor: int


class SharedReducer:
    """The shared-parameter sums of ``plan``, ready to run every step.

    The parameters are looked up and every bucket's flat buffer allocated once, here; each
    ``reduce()`` copies the gradients in, all-reduces every bucket over its group (all in
    flight at once) and copies the sums back. A parameter without a gradient contributes
    zeros and receives the sum.

    Args:
        plan: from ``plan_shared_reductions(shared_param_specs(model), groups.topology)``.
        groups: this rank's groups; must contain every group of ``plan``.
        params: the model's parameters by name (``dict(model.named_parameters())``).

    Raises:
        ValueError: if the plan names an unknown parameter or its topology differs.
    """

    def __init__(
        self, plan: ReductionPlan, groups: ProcessGroups, params: Mapping[str, torch.Tensor]
    ) -> None:
        _check_topology(plan, groups)
        plan.check_names(params, where="a parameter of this model")
        self.plan = plan
        self._buckets: list[_Bucket] = []
        # An expert held by one rank (edp of size 1) still owes the 1/dp: divided in place.
        self._divide_only: list[tuple[torch.Tensor, int]] = []
        for reduction in plan.reductions:
            group = groups.group(reduction.group)
            if group.size == 1:
                if reduction.divisor != 1:
                    self._divide_only += [
                        (params[s.name], reduction.divisor) for s in reduction.buckets.slots
                    ]
                continue
            for bucket in reduction.buckets.buckets:
                members = [(s, params[s.name]) for s in bucket.slots]
                first = members[0][1]
                flat = torch.zeros(bucket.numel, dtype=first.dtype, device=first.device)
                views = tuple(
                    (s.name, p, flat[s.offset : s.offset + s.numel].view(p.shape))
                    for s, p in members
                )
                self._buckets.append(_Bucket(flat, views, group.process_group, reduction.divisor))

    def reduce(self) -> None:
        """Sum the gradients over their groups now (after backward; it commutes with the
        data-parallel mean and with accumulation).

        Raises:
            RuntimeError: on a sparse gradient or one that requires grad (as DataParallel).
        """
        for param, divisor in self._divide_only:
            if param.grad is not None:
                param.grad.div_(divisor)
        pending = []
        for bucket in self._buckets:
            for name, param, view in bucket.params:
                grad = param.grad
                if grad is None:
                    view.zero_()
                    continue
                check_grad(name, grad)
                view.copy_(grad)
            pending.append(dist.all_reduce(bucket.flat, group=bucket.group, async_op=True))
        for work, bucket in zip(pending, self._buckets, strict=True):
            work.wait()
            if bucket.divisor != 1:  # expert gradients: summed over edp, divided by dense dp
                bucket.flat.div_(bucket.divisor)
            for _, param, view in bucket.params:
                if param.grad is None:
                    param.grad = view.clone()
                else:
                    param.grad.copy_(view)


def reduce_shared_gradients(
    module: nn.Module | Iterable[tuple[str, torch.Tensor]],
    groups: ProcessGroups,
    plan: ReductionPlan,
) -> None:
    """Sum the gradients of replicated parameters over their groups, bucketed (docs/design.md §6).

    Expert parameters (the plan's ``"edp"`` reduction) are summed over ``edp`` and divided by
    the dense ``dp``; leave them out of the dense data-parallel mean.

    Call after backward, before or after the data-parallel mean (the two commute): each
    bucket is flattened, all-reduced over its group (all buckets in flight at once) and
    copied back. A parameter without a gradient contributes zeros and receives the sum.
    ``DataParallel(groups=...)`` does this itself from a ``SharedReducer`` it keeps; a loop
    that calls this every step can keep one too (``SharedReducer(plan, groups, params)``).

    Args:
        module: the model, or its ``named_parameters()``.
        groups: this rank's groups; must contain every group of ``plan``.
        plan: from ``plan_shared_reductions(shared_param_specs(model), groups.topology)``.

    Raises:
        ValueError: if the plan names an unknown parameter or its topology differs.
        RuntimeError: on a sparse gradient or one that requires grad (as DataParallel).

    Example:
        >>> loss.backward()
        >>> reduce_shared_gradients(model, groups, plan)
    """
    pairs: Iterable[tuple[str, torch.Tensor]]
    pairs = named_parameters(module) if isinstance(module, nn.Module) else list(module)
    SharedReducer(plan, groups, dict(pairs)).reduce()
