"""What every rank of a pipeline must agree on, and how a failed step ends (docs/pipeline.md).

At construction every rank checks what it was given (its stages are the plan's, the plan is
the process groups' topology); the first problem on any rank is raised on every rank
(``agree_ok``), then the ranks compare the plan's digest (``agree_on``): ranks with different
plans would pair the wrong messages and wait forever. Both run on a gloo group over the world.

In a step, a rank whose stage raised (or whose output lost its agreed shape) keeps sending
and receiving every message of the plan, with zeros, so no peer waits on it
(``runtime.py``); at the end of the step one all-reduce of a flag over the world tells every
rank whether any failed, and only then are the failures gathered, so every rank raises the
same sentence: the first rank's own failure, not the ones it caused downstream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync_core import PipelinePlan
from gradsync_torch._collectives import global_rank
from gradsync_torch.agreement import Disagreement, agree_ok, agree_on


def check_group() -> Any:
    """A gloo group over the world for the agreements (the world itself when it is gloo;
    collective: call on every rank)."""
    if dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")


def _summary(plan: dict[str, Any]) -> str:
    topo = plan["topology"]
    sizes = " x ".join(
        f"{k} {v}" for k, v in topo.items() if k in ("tp", "cp", "dp", "pp") and v > 1
    )
    stages = len(plan["stages"])
    return (
        f"{plan['schedule']} with {plan['microbatches']} microbatches, {stages} stages over {sizes}"
    )


def agree_on_plan(
    plan: PipelinePlan, tied: tuple[tuple[str, str], ...], scale_grads: bool, group: Any
) -> None:
    """The same plan, tied weights and gradient scaling on every rank, or one sentence.

    Raises:
        ValueError: on every rank, naming two ranks' plans, when they differ.
    """
    payload = {"plan": plan.to_json(), "tied": [list(t) for t in tied], "scale": scale_grads}

    def describe(d: Disagreement) -> str:
        mine, theirs = d.base, d.other
        if mine["plan"] != theirs["plan"]:
            what = (
                f"rank {d.base_rank} runs {_summary(mine['plan'])}, rank {d.other_rank} "
                f"runs {_summary(theirs['plan'])}"
            )
            if _summary(mine["plan"]) == _summary(theirs["plan"]):
                what = (
                    f"the plans of ranks {d.base_rank} and {d.other_rank} differ in their actions"
                )
        elif mine["tied"] != theirs["tied"]:
            what = f"rank {d.base_rank} ties {mine['tied']}, rank {d.other_rank} {theirs['tied']}"
        else:
            what = (
                f"rank {d.base_rank} has scale_grads={mine['scale']}, rank {d.other_rank} "
                f"{theirs['scale']}"
            )
        return (
            f"the ranks build different pipelines (ranks {d.agreeing} agree with rank "
            f"{d.base_rank}, ranks {d.differing} do not): {what}; build the same plan with "
            "the same arguments on every rank"
        )

    agree_on(payload, group, describe=describe)


def agree_setup(error: str | None, group: Any) -> None:
    """Raise the first rank's construction problem on every rank."""
    agree_ok(error, group, what="cannot build the pipeline")


@dataclass(frozen=True, slots=True)
class Failure:
    """Why this rank's step failed: ``cause`` is the rank's own failure, ``False`` when it
    only received a failed peer's zeros."""

    message: str
    cause: bool


def end_step(failure: Failure | None, group: Any, step: int) -> None:
    """One flag over the world: raise the first failed rank's sentence on every rank.

    Raises:
        RuntimeError: on every rank, when any rank's step failed.
    """
    flag = torch.tensor([0 if failure is None else 1], dtype=torch.int32)
    world = dist.get_world_size(group)
    if world > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    if not flag.item():
        return
    failures: list[Any] = [failure]
    if world > 1:
        failures = [None] * world
        dist.all_gather_object(failures, failure, group=group)
    causes = [(r, f) for r, f in enumerate(failures) if f is not None and f.cause]
    rank, first = (causes or [(r, f) for r, f in enumerate(failures) if f is not None])[0]
    raise RuntimeError(
        f"pipeline step {step} failed on rank {global_rank(group, rank)}: {first.message}; "
        "every rank stopped at the end of the step (its gradients are not usable)"
    )
