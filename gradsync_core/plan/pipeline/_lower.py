"""Lowering a compute order to everything a rank runs: torch's passes (docs/pipeline.md).

torch's ``_prepare_schedule_with_comms``, pass by pass: ``UNSHARD``/``RESHARD`` around each
stage's compute (ZeRO-3, ``_add_unshard_reshard``), ``REDUCE_GRAD`` after each stage's last
backward (``_add_reduce_grad``), then the sends and receives, placed as ``_add_send_recv``
places them, so a lowered plan is torch's ``pipeline_order_with_comms``.
"""

from __future__ import annotations

from collections.abc import Sequence

from gradsync_core.plan.pipeline._actions import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    FULL_BACKWARD,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    Action,
)

Orders = list[list[Action]]


def add_unshard_reshard(ops: Sequence[Action], max_active_stages: int = 3) -> list[Action]:
    """ZeRO-3 points: torch's ``_add_unshard_reshard``. Before each compute, unshard the next
    ``max_active_stages`` distinct stages this rank computes (prefetch) and reshard the
    active ones not among them; reshard what is left at the end."""
    # A set, as torch's: which of several stages is resharded first follows CPython's
    # iteration order of a set of ints, which is deterministic, and torch's order is the goal.
    active: set[int] = set()
    out: list[Action] = []
    for action, upcoming in zip(ops, _next_stages(ops, max_active_stages), strict=True):
        fetch = [s for s in upcoming if s not in active]
        for stage in [s for s in active if s not in upcoming]:
            active.remove(stage)
            out.append(Action(stage, RESHARD))
        for stage in fetch:
            active.add(stage)
            out.append(Action(stage, UNSHARD))
        out.append(action)
    out += [Action(stage, RESHARD) for stage in list(active)]
    return out


def _next_stages(ops: Sequence[Action], count: int) -> list[list[int]]:
    """For each position, the distinct stages computed from there on, in order of first
    appearance, through the action that brings them to ``count`` (torch's
    ``next_stage_indices``: an overlapped pair may bring one more). Built from the end, so
    the walk is linear even where a rank has fewer than ``count`` stages."""
    out: list[list[int]] = [[] for _ in ops]
    firsts: list[tuple[int, int]] = []  # (stage, where it first appears from here on)
    for i in range(len(ops) - 1, -1, -1):
        here = list(dict.fromkeys(leaf.stage for leaf in ops[i].leaves))
        firsts = [(s, i) for s in here] + [(s, j) for s, j in firsts if s not in here]
        cut = firsts[count - 1][1] if len(firsts) >= count else len(ops)
        out[i] = [s for s, j in firsts if j <= cut]
    return out


def add_reduce_grad(ops: Sequence[Action], microbatches: int) -> list[Action]:
    """A ``REDUCE_GRAD`` right after each stage's last full or weight backward: torch's
    ``_add_reduce_grad``; the stage's gradients are final there, so data parallelism reduces
    them while the pipeline drains."""
    done: dict[int, int] = {}
    out: list[Action] = []
    for action in ops:
        out.append(action)
        for leaf in action.leaves:
            if leaf.kind in (FULL_BACKWARD, BACKWARD_WEIGHT):
                done[leaf.stage] = done.get(leaf.stage, 0) + 1
                if done[leaf.stage] == microbatches:
                    out.append(Action(leaf.stage, REDUCE_GRAD))
    return out


def add_send_recv(
    orders: Sequence[Sequence[Action]], ranks: Sequence[int], num_stages: int
) -> Orders:
    """The sends and receives: torch's ``_add_send_recv``. Ranks take turns, each scheduling its
    next action once its input is local or received; a send is written right after the compute
    that produced it and its receive at that moment on the peer, so each pair of ranks posts
    its sends and receives in the same order.

    Raises:
        ValueError: when no rank can take its next action (a malformed order).
    """

    def comms(leaf: Action) -> tuple[Action, Action] | None:
        s = leaf.stage
        if leaf.kind == FORWARD and s != num_stages - 1 and ranks[s + 1] != ranks[s]:
            return Action(s, SEND_F, leaf.microbatch), Action(s + 1, RECV_F, leaf.microbatch)
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT) and s != 0 and ranks[s - 1] != ranks[s]:
            return Action(s, SEND_B, leaf.microbatch), Action(s - 1, RECV_B, leaf.microbatch)
        return None

    def ready(leaf: Action, seen: set[Action]) -> bool:
        s, mb = leaf.stage, leaf.microbatch
        if leaf.kind == FORWARD and s != 0:
            return Action(s, RECV_F, mb) in seen or Action(s - 1, FORWARD, mb) in seen
        if leaf.kind in (FULL_BACKWARD, BACKWARD_INPUT) and s != num_stages - 1:
            return (
                Action(s, RECV_B, mb) in seen
                or Action(s + 1, BACKWARD_INPUT, mb) in seen
                or Action(s + 1, FULL_BACKWARD, mb) in seen
            )
        return True

    pending = {rank: list(ops) for rank, ops in enumerate(orders) if ops}
    out: Orders = [[] for _ in orders]
    seen: list[set[Action]] = [set() for _ in orders]
    while pending:
        progress = False
        for rank in sorted(pending):
            action = pending[rank][0]
            if not all(ready(leaf, seen[rank]) for leaf in action.leaves):
                continue
            out[rank].append(action)
            for leaf in action.leaves:
                seen[rank].add(leaf)
                pair = comms(leaf)
                if pair is not None:
                    send, recv = pair
                    out[rank].append(send)
                    seen[rank].add(send)
                    out[ranks[recv.stage]].append(recv)
                    seen[ranks[recv.stage]].add(recv)
            pending[rank].pop(0)
            if not pending[rank]:
                del pending[rank]
            progress = True
        if not progress:
            stuck = ", ".join(f"rank {r} at {pending[r][0]}" for r in sorted(pending))
            raise ValueError(
                f"the compute order cannot be lowered to sends and receives: no rank can take "
                f"its next action ({stuck}); each forward needs the previous stage's forward "
                "and each backward the next stage's backward earlier in the order"
            )
    return out


def lower(
    orders: Sequence[Sequence[Action]],
    ranks: Sequence[int],
    microbatches: int,
    *,
    zero3: bool,
) -> Orders:
    """A compute-only order lowered as torch's ``_prepare_schedule_with_comms`` lowers it."""
    lowered = [add_unshard_reshard(ops) if zero3 else list(ops) for ops in orders]
    lowered = [add_reduce_grad(ops, microbatches) for ops in lowered]
    return add_send_recv(lowered, ranks, len(ranks))
