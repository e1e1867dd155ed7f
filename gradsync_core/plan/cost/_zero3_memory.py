"""ZeRO-3's peak memory per executor: what each one's step holds, moment by moment.

``torch_peak`` walks ``fully_shard``'s step buffer by buffer; ``xla_peak`` walks JAX's
``zero3_step``, one XLA program with its parameters and optimizer state donated. Both take
``estimate_zero3``'s model states and return them with each rank's transient bytes the step's
worst moment (``predict_zero3`` calls them; ``estimate_zero3`` stays the CLI's bound over the
phases' maxima, which needs no model profile).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from gradsync_core.plan._memory import MemoryEstimate, gathered_bytes, zero3_unit_bytes
from gradsync_core.plan._param_shards import ParamShardPlan
from gradsync_core.plan._param_units import ROOT
from gradsync_core.plan._specs import itemsize
from gradsync_core.plan.cost._machine import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, MachineProfile
from gradsync_core.plan.cost._model_profile import ModelProfile

_STATE, _ACTIVATIONS, _SCRATCH = range(3)  # what a buffer of torch_peak's live set counts as


def torch_peak(
    plan: ParamShardPlan,
    memory: MemoryEstimate,
    model: ModelProfile,
    unit_of_block: Sequence[int],
    *,
    machine: MachineProfile,
    reshard: bool,
    prefetch: int,
    overlap: bool,
    tied: Iterable[str],
) -> tuple[MemoryEstimate, int | None, int]:
    """The most ``fully_shard``'s step holds at once (gradsync_torch ``param_sharding``'s
    hooks and ``UnitParameters``), walked buffer by buffer; each unit's sizes are
    ``zero3_unit_bytes``.

    Beside the parameters' chunks and the optimizer state, always there:

    - a gather: the all-gather's input (this rank's chunks) and output, and the collective's
      scratch (``MachineProfile.scratch_bytes``), from its issue (a prefetch: ``prefetch``
      units ahead, issued once the unit before is gathered) until it is waited for; then
      the unit's parameters, copied out, beside the input and output until they are freed;
    - a gathered unit lives from its pre-forward to its post-forward with
      ``reshard_after_forward`` (the root to the backward's end), else to its post-backward;
      the backward gathers it again (prefetched the same way) before its first block;
    - the backward: each block's gradients are made beside its activations (a tied
      parameter's twice more, as autograd accumulates them); when a unit's backward is done,
      the reduce-scatter before it is waited for (its input and scratch freed; under HSDP its
      shard's all-reduce issued, whose scratch lives until the next one's), the input is made
      beside the gradients, which are then dropped, and the unit's gradient shard and the
      collective's scratch appear (waited for at once without ``overlap``); then the unit is
      freed. The root reduces once the whole backward is done;
    - the step starts with no gradient (``zero_grad()``'s default frees them), so after the
      backward every gradient shard is there and nothing else;
    - the activations are the profile's, each block's alive from its forward to the end of
      its backward (the gradient flowing between blocks is not counted).

    Returns the estimate with each rank's ``transient_bytes`` the worst moment beyond the
    parameters, state, every gradient shard, activations and scratch; the activations then
    (None when the profile lacks them); and the scratch then. The worst moment holds at least
    every gradient shard (the backward's end does), so the three split what it holds beyond:
    the scratch, the activations, then the rest; when the gradients not yet made there
    outweigh the gathered units and buffers, the activations count what is left.
    """
    n = plan.shard_size
    tied = set(tied)
    sizes = [zero3_unit_bytes(plan, u, tied=tied) for u in plan.units]
    gather_scratch = [machine.scratch_bytes(ALL_GATHER, b.gathered) if n > 1 else 0 for b in sizes]
    reduce_scratch = [
        machine.scratch_bytes(REDUCE_SCATTER, b.reduce_input) if n > 1 else 0 for b in sizes
    ]
    hsdp = plan.replicate_size > 1
    blocks = range(len(model.blocks))
    made, twice = [0] * len(blocks), [0] * len(blocks)  # gradient bytes each block makes
    for p in plan.params:
        if p.requires_grad:
            block = model.block_of(p.name)
            made[block] += gathered_bytes(plan, [p.name])
            twice[block] += 2 * gathered_bytes(plan, [p.name]) if p.name in tied else 0
    roots = sorted(u.index for u in plan.units if u.prefix == ROOT)
    order = list(dict.fromkeys(u for u in unit_of_block if u not in roots))
    first = {u: unit_of_block.index(u) for u in order}
    last = {u: max(b for b in blocks if unit_of_block[b] == u) for u in order}
    live: dict[tuple[str, int], tuple[int, int]] = {}  # (what, unit) -> (bytes, kind)
    moments: list[tuple[int, int, int]] = []  # beyond parameters and state; activations; scratch
    pending: list[int] = []  # the reduce-scatter not waited for

    def note(extra: int = 0) -> None:
        held = [0, 0, 0]
        for nbytes, kind in live.values():
            held[kind] += nbytes
        moments.append((sum(held) + extra, held[_ACTIVATIONS], held[_SCRATCH]))

    def issue(u: int) -> None:  # start_gather
        if ("gathered", u) in live or ("output", u) in live or not sizes[u].gathered:
            return
        live[("input", u)] = (sizes[u].send, _STATE)
        live[("output", u)] = (sizes[u].gathered, _STATE)
        live[("all-gather", u)] = (gather_scratch[u], _SCRATCH)
        note()

    def gather(u: int, sequence: list[int]) -> None:  # a pre-forward or pre-backward hook
        if ("gathered", u) not in live and sizes[u].gathered:
            issue(u)
            del live[("all-gather", u)]  # waited for
            live[("gathered", u)] = (sizes[u].gathered, _STATE)
            note()  # copied out of the gather's output
            del live[("input", u)], live[("output", u)]
        at = sequence.index(u)
        for k in sequence[at + 1 : at + 1 + prefetch]:
            issue(k)

    def finish_reduce() -> None:
        if not pending:
            return
        u = pending.pop()
        del live[("reduce input", u)], live[("reduce-scatter", u)]
        if hsdp:  # its shard all-reduced over the replicas, one in flight at a time
            for key in [k for k in live if k[0] == "all-reduce"]:
                del live[key]
            live[("all-reduce", u)] = (machine.scratch_bytes(ALL_REDUCE, sizes[u].shard), _SCRATCH)
            note()
            if not overlap:
                del live[("all-reduce", u)]

    def reduce(u: int) -> None:  # a unit's post-backward
        finish_reduce()
        if not sizes[u].shard:
            return
        live[("reduce input", u)] = (sizes[u].reduce_input, _STATE)
        note()  # beside the gradients it is copied from
        live.pop(("gradients", u), None)
        live[("shard", u)] = (sizes[u].shard, _STATE)
        live[("reduce-scatter", u)] = (reduce_scratch[u], _SCRATCH)
        note()
        pending.append(u)
        if not overlap:
            finish_reduce()

    acts = [b.activation_bytes or 0 for b in model.blocks]
    forward = [*roots, *order]
    for u in roots:
        gather(u, forward)
    alive = 0
    for b in blocks:
        u = unit_of_block[b]
        if first.get(u) == b:
            gather(u, forward)
        alive += acts[b]
        live[("activations", 0)] = (alive, _ACTIVATIONS)
        note()
        if last.get(u) == b and reshard:
            live.pop(("gathered", u), None)
    backward = [*roots, *reversed(order)]
    for u in roots:
        gather(u, backward)
    for b in reversed(blocks):
        u = unit_of_block[b]
        if last.get(u) == b:
            gather(u, backward)
        held = live.get(("gradients", u), (0, _STATE))[0]
        live[("gradients", u)] = (held + made[b], _STATE)
        note(twice[b])
        alive -= acts[b]
        live[("activations", 0)] = (alive, _ACTIVATIONS)
        if first.get(u) == b:
            reduce(u)
            live.pop(("gathered", u), None)
    for u in roots:
        reduce(u)
    finish_reduce()
    for key in [k for k in live if k[0] in ("all-reduce", "gathered")]:
        del live[key]
    note()  # every gradient shard
    total, activations, scratch = max(moments, key=lambda m: m[0])
    beyond = total - sum(b.shard for b in sizes)
    scratch = min(scratch, beyond)
    activations = min(activations, beyond - scratch)
    ranks = tuple(replace(r, transient_bytes=beyond - scratch - activations) for r in memory.ranks)
    known = all(b.activation_bytes is not None for b in model.blocks)
    return replace(memory, ranks=ranks), activations if known else None, scratch


def xla_peak(
    plan: ParamShardPlan,
    memory: MemoryEstimate,
    model: ModelProfile,
    unit_of_block: Sequence[int],
    reshard: bool,
) -> tuple[MemoryEstimate, int | None]:
    """The model states of JAX's ``zero3_step`` at its worst moment, and the activations then.

    The step is one XLA program, the parameters' chunks and the optimizer state donated (so
    they are counted once, arguments aliased to outputs); every other buffer lives from the
    operation that writes it to the last that reads it. Nothing runs beside compute (XLA:CPU
    waits for each collective where it is issued), so nothing is prefetched. What XLA:CPU's
    buffer assignment of the step shows, and this walk follows block by block:

    - forward: with ``reshard`` one unit is gathered at a time, freed after its blocks;
      without, every unit the backward reads stays gathered from its forward to its
      backward (XLA saves the all-gather's output as a residual);
    - the first unit's backward reads none of its parameters: its input is the data, which
      needs no gradient, so only its parameters' gradients are computed, from the saved
      activations (true of a first linear layer or an embedding); it is neither kept nor
      gathered again;
    - backward, per unit: its input gradient is computed with its gathered parameters, which
      are then free; its whole (padded) gradient is made and, with ``reshard``, the next
      unit's gather is issued before this gradient is reduce-scattered, so the two are alive
      together (without ``reshard`` the next units are already kept);
    - with ``reshard``, each unit gathered again reads its chunk through a copy one row
      longer (``_read_after``'s ordering, gradsync_jax param_sharding/gather.py), which
      depends on the parameters alone, so XLA makes it at the step's start and holds it to
      that gather;
    - each unit's reduce-scattered gradient is stepped by the optimizer at once, in place
      (an elementwise update: Adam, SGD); under HSDP the shards' all-reduces over the
      replicas are combined by XLA into one at the backward's end, so every gradient shard
      is alive then, twice (the all-reduce's input and output);
    - the activations are the profile's, each block's alive from its forward to its
      backward.

    Returns the estimate with each rank's ``gradient_bytes`` what is resident after the
    backward (none without HSDP: stepped as they come) and ``transient_bytes`` the rest of
    the worst moment beyond parameters, gradients, state and activations; and the
    activations at that moment (None when the profile lacks them).
    """
    n = plan.shard_size
    gathered = [plan.unit_padded_nbytes(u.index) * n for u in plan.units]
    grads = [plan.unit_padded_nbytes(u.index, trainable_only=True) for u in plan.units]
    copies = [
        sum(
            (plan.chunk(p, 0).padded_numel + plan.chunk(p, 0).row_numel)
            * itemsize(plan.param(p).dtype)
            for p in u.params
        )
        for u in plan.units
    ]
    acts = [b.activation_bytes or 0 for b in model.blocks]
    known = all(b.activation_bytes is not None for b in model.blocks)
    blocks = range(len(model.blocks))
    order = list(dict.fromkeys(u for u in unit_of_block if gathered[u]))
    first = {u: unit_of_block.index(u) for u in order}  # a unit's first block, forward
    last = {u: max(b for b in blocks if unit_of_block[b] == u) for u in order}
    reads = {u: not (order and u == order[0] and first[u] == last[u]) for u in order}
    again = [u for u in order if reshard and reads[u]]  # gathered again for the backward
    hsdp = plan.replicate_size > 1
    moments: list[tuple[int, int]] = []  # (model-state bytes beyond the resident, activations)
    pending = sum(copies[u] for u in again)
    alive = 0
    for b in blocks:  # forward
        alive += acts[b]
        u = unit_of_block[b]
        if u not in first:
            moments.append((pending, alive))
            continue
        held = (
            gathered[u]
            if reshard
            else sum(gathered[k] for k in order if first[k] <= b and (reads[k] or k == u))
        )
        moments.append((pending + held, alive))
    done = 0  # gradient shards reduced and not yet stepped (HSDP)
    for b in reversed(blocks):  # backward
        u = unit_of_block[b]
        kept = sum(gathered[k] for k in order if reads[k] and first[k] <= b)
        if u in first and reshard and reads[u] and b == last[u]:
            pending -= copies[u]  # its gather again reads the copy, then frees it
        held = (gathered[u] if reads.get(u) else 0) if reshard else kept
        moments.append((pending + held + done, alive))
        if u in first and b == first[u]:  # its backward is done: its whole gradient
            if reshard:  # beside the next unit's gather, which has read its copy
                before = [k for k in order if first[k] < first[u] and reads[k]]
                nxt = before[-1] if before else None  # gathered, its copy read and freed
                held = 0 if nxt is None else gathered[nxt] - copies[nxt]
            else:  # its own parameters free, the earlier units kept
                held = kept - (gathered[u] if reads[u] else 0)
            moments.append((pending + held + done + grads[u] * n + grads[u], alive))
            done += grads[u] if hsdp else 0
        alive -= acts[b]
    if hsdp:  # the combined all-reduce: every shard, in and out
        moments.append((2 * done, 0))
    worst, activations = max(moments, key=lambda m: m[0] + m[1])
    resident = done if hsdp else 0
    ranks = tuple(
        replace(
            r,
            gradient_bytes=resident,
            transient_bytes=max(0, worst - resident),
        )
        for r in memory.ranks
    )
    return replace(memory, ranks=ranks), activations if known else None
