"""``Pipeline``: runs this rank's actions of a ``PipelinePlan`` (docs/pipeline.md).

The plan says everything: which stages this rank holds, in what order it runs their forwards
and backwards (whole, or zero bubble's input and weight halves) on which microbatch, when it
sends and receives, where a stage's gradients are final (``REDUCE_GRAD``: the data-parallel
reduction and the 1/microbatches scale, as torch's ``perform_reduce_grad``) and, under
ZeRO-3, when a stage's parameters are gathered and freed. The executor takes the actions in
order and does each as torch's ``_PipelineScheduleRuntime`` does, with the same autograd
calls (``backward.py``), so a plan and torch's schedule of the same name give the same bits;
what differs is that gradients are summed in microbatch order under every schedule, and that
on gloo every receive of a step is posted at its start, in the plan's order (a gloo receive
posted after its send costs a round trip between the two ranks); the computes keep the
plan's order.

A stage module is a plain module, a ``DataParallel`` built with ``overlap=False`` (the plan
says when to reduce: ``sync_gradients()`` at ``REDUCE_GRAD``) or a ``fully_shard``-ed module
(its hooks gather and reduce-scatter; gradient sync is off except for the stage's last
backward, so the gradients accumulate unsharded and are reduce-scattered once, and
``UNSHARD``/``RESHARD`` gather and free at the plan's points). Tensor parallelism inside a
stage needs nothing here: its layers take the tp group of the same ``Topology``, and each
tp rank sends to the tp rank of the next stage, its peer in the pipeline group.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import PipelinePlan, TimedAction
from gradsync_core.plan.pipeline import (
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    COMMS,
    FORWARD,
    FULL_BACKWARD,
    OVERLAP_F_B,
    RECV_B,
    RECV_F,
    REDUCE_GRAD,
    RESHARD,
    SEND_B,
    SEND_F,
    UNSHARD,
    Action,
)
from gradsync_torch._specs import unwrapped
from gradsync_torch.data_parallel import DataParallel
from gradsync_torch.groups import ProcessGroups
from gradsync_torch.param_sharding import ShardedModule
from gradsync_torch.pipeline.agreement import (
    Failure,
    agree_on_plan,
    agree_setup,
    check_group,
    end_step,
)
from gradsync_torch.pipeline.backward import MicrobatchOrder, SplitBackward, full_backward
from gradsync_torch.pipeline.p2p import Messages, describe_metas, metas_of

LossFn = Callable[[Any, Any], torch.Tensor]


def _kind(module: nn.Module) -> str:
    if isinstance(module, DataParallel):
        return "dp"
    if any(isinstance(m, ShardedModule) for m in module.modules()):
        return "sharded"
    return "plain"


class _Stage:
    """One stage this rank holds and what it keeps during a step."""

    def __init__(self, index: int, module: nn.Module, plan: PipelinePlan) -> None:
        ranks, n = plan.stage_ranks, plan.num_stages
        self.index, self.module = index, module
        self.first, self.last = index == 0, index == n - 1
        self.prev_local = not self.first and ranks[index - 1] == ranks[index]
        self.next_local = not self.last and ranks[index + 1] == ranks[index]
        self.kind = _kind(module)
        self.order = MicrobatchOrder([p for p in module.parameters() if p.requires_grad])
        self.reset()

    def reset(self) -> None:
        self.fwd: dict[int, tuple[tuple[torch.Tensor, ...], tuple[Any, ...]]] = {}
        self.split: dict[int, SplitBackward] = {}
        self.inputs_in: dict[int, tuple[torch.Tensor, ...]] = {}  # from the previous stage, here
        self.grads_in: dict[int, tuple[torch.Tensor | None, ...]] = {}  # from the next, here
        self.grads_out: dict[int, tuple[torch.Tensor | None, ...]] = {}  # for SEND_B
        self.losses: dict[int, torch.Tensor] = {}
        self.backwards = 0  # full or weight backwards run this step
        self.order.reset()


def _setup_error(
    plan: Any,
    stages: Any,
    groups: Any,
    loss_fn: Any,
    tied: Any,
) -> str | None:
    """This rank's construction problem, as one sentence, or ``None``."""
    if not isinstance(plan, PipelinePlan):
        return f"plan must be a gradsync_core.PipelinePlan, got {type(plan).__name__}"
    if not isinstance(groups, ProcessGroups):
        return f"groups must be the topology's ProcessGroups, got {type(groups).__name__}"
    if groups.topology != plan.topology:
        return (
            f"the plan is for {plan.topology} (pp = {plan.pp}) but the process groups are for "
            f"{groups.topology} (pp = {groups.topology.pp}); plan with the groups' topology"
        )
    if not callable(loss_fn):
        return "loss_fn must be callable: loss_fn(last stage's output, target) -> loss"
    if not isinstance(stages, Mapping) or not all(
        isinstance(m, nn.Module) for m in stages.values()
    ):
        return "stages must map each stage index this rank holds to its nn.Module"
    pp_rank = groups.group_rank("pp")
    want = sorted(s.index for s in plan.stages_of(pp_rank))
    if sorted(stages) != want:
        return (
            f"pipeline rank {pp_rank} holds stages {want} of the plan ({plan.schedule}: "
            f"{plan.num_stages} stages over pp = {plan.pp}, {plan.placement} placement), but "
            f"was given modules for stages {sorted(stages)}; give it exactly those "
            "(split_model(blocks, plan, pp_rank).stages)"
        )
    split = any(a.kind in (BACKWARD_INPUT, BACKWARD_WEIGHT) for row in plan.actions for a in row)
    for index, module in sorted(stages.items()):
        kind = _kind(module)
        if isinstance(module, nn.parallel.DistributedDataParallel):
            return (
                f"stage {index} is a torch DistributedDataParallel, which all-reduces every "
                "microbatch's backward; wrap it in gradsync's DataParallel(..., overlap=False) "
                "so it reduces once, where the plan says"
            )
        if kind == "dp" and module.options.overlap:
            return (
                f"stage {index}'s DataParallel reduces during backward (overlap=True); build "
                "it with overlap=False: the plan's REDUCE_GRAD says when to reduce"
            )
        if (kind == "sharded") != plan.zero3:
            return (
                f"stage {index} is {'' if kind == 'sharded' else 'not '}fully_shard-ed but the "
                f"plan has zero3={plan.zero3}; plan with zero3={kind == 'sharded'}"
            )
        if kind == "sharded" and split:
            return (
                f"stage {index} is fully_shard-ed and the {plan.schedule} plan splits "
                "backwards into input and weight gradients, which fully_shard's hooks do not "
                "follow; use a schedule with full backwards (GPipe, 1F1B, Interleaved1F1B)"
            )
        order = [
            a.microbatch
            for row in plan.actions
            for a in row
            if a.stage == index and a.kind in (FULL_BACKWARD, BACKWARD_WEIGHT)
        ]
        if kind == "sharded" and order != sorted(cast(list[int], order)):  # backwards: ints
            return (
                f"stage {index} is fully_shard-ed and {plan.schedule} runs its backwards out of "
                "microbatch order, which sharded gradients cannot be reordered to; use a "
                "schedule that runs them in order (GPipe, 1F1B, Interleaved1F1B)"
            )
    if not isinstance(tied, Sequence) or not all(
        isinstance(t, Sequence) and len(t) == 2 and all(isinstance(n, str) for n in t) for t in tied
    ):
        return "tied must be pairs of parameter names, e.g. split_model(...).tied"
    return None


class Pipeline:
    """Runs a ``PipelinePlan`` on this rank's stage modules (docs/pipeline.md).

    Construct on every rank of the world (collective); each rank passes the modules of the
    stages the plan places on its pipeline rank (``split_model(blocks, plan, pp_rank).stages``,
    or modules you built, as torch's ``PipelineStage`` takes them), each plain, in a
    ``DataParallel(..., overlap=False)`` (data parallelism) or ``fully_shard``-ed (ZeRO-3,
    with a ``zero3=True`` plan).

    Args:
        plan: the plan; every rank must build the same one (checked).
        stages: this rank's stage modules by stage index.
        groups: the ``ProcessGroups`` of ``plan.topology``: ``groups["pp"]`` carries the
            activations, ``groups["dp"]`` the stages' data-parallel reduction.
        loss_fn: ``loss_fn(output, target)`` on the last stage's output, per microbatch.
        tied: weights the model shares between two stages, as pairs of their names
            (``split_model(...).tied``): their gradients are summed after the step, as
            Megatron-core sums the embedding's and the output layer's.
        scale_grads: divide the gradients by the number of microbatches at each stage's
            ``REDUCE_GRAD`` (torch's default): with a mean loss per microbatch, the step's
            gradient is the mean over the batch.

    Raises:
        ValueError: on every rank, with the first rank's problem: stages other than the
            plan's, a plan for another topology, ranks with different plans, a
            ``DataParallel`` that reduces during backward, a tied name no stage holds.

    Example:
        >>> split = split_model(blocks, plan, groups.group_rank("pp"))  # doctest: +SKIP
        >>> pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=F.cross_entropy,
        ...                 tied=split.tied)
        >>> opt = torch.optim.AdamW(pipe.parameters())
        >>> losses = pipe.step(tokens, target=labels)  # on the last stage's rank: per microbatch
        >>> opt.step(); opt.zero_grad()
    """

    def __init__(
        self,
        plan: PipelinePlan,
        stages: Mapping[int, nn.Module],
        *,
        groups: ProcessGroups,
        loss_fn: LossFn,
        tied: Sequence[tuple[str, str]] = (),
        scale_grads: bool = True,
    ) -> None:
        if not dist.is_initialized():
            raise RuntimeError("Pipeline needs torch.distributed: call init_process_group first")
        self._check = check_group()
        agree_setup(_setup_error(plan, stages, groups, loss_fn, tied), self._check)
        tied = tuple((a, b) for a, b in tied)
        agree_on_plan(plan, tied, scale_grads, self._check)
        self.plan = plan
        self.tied = tied
        self.loss_fn = loss_fn
        self.scale_grads = scale_grads
        self.pp_rank = groups.group_rank("pp")
        self._stages = {s: _Stage(s, stages[s], plan) for s in sorted(stages)}
        self._actions = plan.actions[self.pp_rank]
        first = next((p for m in stages.values() for p in m.parameters()), None)
        self.device = first.device if first is not None else torch.device("cpu")
        self._messages = self._make_messages(groups)
        pp = groups["pp"]
        if pp.size > 1 and "nccl" in str(dist.get_backend(pp.process_group)):
            # NCCL: the first batch_isend_irecv on a group must involve all its ranks, so
            # the communicator starts here, once, with every rank of the pipeline group.
            dist.all_reduce(torch.zeros(1, device=self.device), group=pp.process_group)
        self._ties = self._make_ties(groups, tied)
        self.steps = 0
        self.peak_stash = 0  # the most (stage, microbatch) activations held at once, last step
        self._broken: str | None = None
        self._failure: Failure | None = None
        self._live = 0
        self._mb_args: list[tuple[Any, ...]] | None = None
        self._mb_targets: list[Any] | None = None
        # Set to [] to record each step's actions, in seconds from the step's start: every
        # compute from the moment its input is here, every send and receive while this rank
        # posts it (a batch goes out with its last one), every REDUCE_GRAD, UNSHARD and
        # RESHARD: what benchmarks/torch_pipeline.py compares with simulate_pipeline's
        # timeline. step_seconds: the last step's actions, end to end.
        self.timeline: list[TimedAction] | None = None
        self.step_seconds = 0.0
        self._step_began = 0.0
        self._began: float | None = None

    # ---- construction ------------------------------------------------------------------

    def _make_messages(self, groups: ProcessGroups) -> Messages | None:
        """The pipeline group and a gloo group over its ranks for the metadata (every
        rank creates every pipeline group's, in order: ``new_group`` is collective)."""
        pp = groups["pp"]
        if pp.size == 1:
            return None
        mine = None
        for ranks in self.plan.topology.groups("pp"):
            meta = dist.new_group(list(ranks), backend="gloo")
            if ranks == pp.ranks:
                mine = meta
        assert mine is not None
        return Messages(pp.process_group, mine, self.plan.stage_ranks, self.device)

    def _make_ties(
        self, groups: ProcessGroups, tied: tuple[tuple[str, str], ...]
    ) -> list[tuple[nn.Parameter | None, nn.Parameter | None, Any]]:
        """For each tied pair: this rank's copies and the two ranks' group (``None`` when one
        rank holds both). Where each name lives is gathered over the world, so every rank
        creates the same groups."""
        if not tied:
            return []
        wanted = {n for pair in tied for n in pair}
        here = {
            name: (index, stage.kind)
            for index, stage in self._stages.items()
            for name, _ in unwrapped(stage.module).named_parameters()
            if name in wanted
        }
        everywhere: list[Any] = [None] * dist.get_world_size(self._check)
        dist.all_gather_object(everywhere, here, group=self._check)
        holders: dict[str, set[int]] = {}
        for held in everywhere:
            for name, (index, kind) in held.items():
                holders.setdefault(name, set()).add(index)
                if kind == "sharded":
                    raise ValueError(
                        f"tied weight {name!r} is in a fully_shard-ed stage; summing sharded "
                        "gradients of tied weights across stages is not supported yet"
                    )
        out = []
        rank = dist.get_rank()
        for a, b in tied:
            for name in (a, b):
                if len(holders.get(name, ())) != 1:
                    where = sorted(holders.get(name, ()))
                    raise ValueError(
                        f"tied weight {name!r} is held by stages {where}; each name of a tied "
                        "pair must be a parameter of exactly one stage (split_model(...).tied)"
                    )
            sa, sb = min(holders[a]), min(holders[b])
            pa = self._param(sa, a)
            pb = self._param(sb, b)
            group = None
            if self.plan.stage_ranks[sa] != self.plan.stage_ranks[sb]:
                for g in range(self.plan.topology.group_count("pp")):
                    pair = sorted({self.plan.global_ranks(sa)[g], self.plan.global_ranks(sb)[g]})
                    made = dist.new_group(pair)
                    if rank in pair:
                        group = made
            out.append((pa, pb, group))
        return out

    def _param(self, stage: int, name: str) -> nn.Parameter | None:
        held = self._stages.get(stage)
        return None if held is None else unwrapped(held.module).get_parameter(name)

    # ---- the public surface --------------------------------------------------------------

    @property
    def stages(self) -> dict[int, nn.Module]:
        """This rank's stage modules by stage index."""
        return {s: st.module for s, st in self._stages.items()}

    def parameters(self) -> Iterator[nn.Parameter]:
        """Every parameter of this rank's stages (for its optimizer)."""
        for stage in self._stages.values():
            yield from stage.module.parameters()

    def step(self, *inputs: torch.Tensor, target: Any = None) -> list[torch.Tensor] | None:
        """Run one training step: every microbatch's forward and backward, the reductions.

        Args:
            inputs: the batch, on the rank that holds stage 0 (ignored elsewhere); split into
                ``plan.microbatches`` microbatches along dimension 0.
            target: the batch's targets, on the rank that holds the last stage.

        Returns:
            On the rank holding the last stage, each microbatch's loss (detached); else
            ``None``.

        Raises:
            RuntimeError: on every rank, when a stage raised on any rank, a stage's output
                lost the shapes agreed at the first step, or the batch does not split; the
                step's gradients are then unusable and the pipeline refuses further steps.
        """
        if self._broken is not None:
            raise RuntimeError(f"the pipeline failed in an earlier step ({self._broken})")
        self.steps += 1
        try:
            self._run(inputs, target)
            end_step(self._failure, self._check, self.steps)
        except BaseException as e:
            # A failed step leaves messages and gradients half done: no further step.
            self._broken = str(e)
            raise
        last = self._stages.get(self.plan.num_stages - 1)
        if last is None:
            return None
        return [last.losses[mb].detach() for mb in range(self.plan.microbatches)]

    # ---- one step ------------------------------------------------------------------------

    def _run(self, inputs: tuple[Any, ...], target: Any) -> None:
        """Every action of this rank, then the step's sends and receives completed and the
        tied gradients summed; a compute that raises is recorded, not raised."""
        self._failure = None
        self._live = self.peak_stash = 0
        self._step_began = time.perf_counter()
        if self.timeline is not None:
            self.timeline = []
        for stage in self._stages.values():
            stage.reset()
        self._split_batch(inputs, target)
        actions, i = self._actions, 0
        if self._messages is not None and self._messages.early:
            self._post_receives()
            actions = tuple(a for a in actions if a.kind not in (RECV_F, RECV_B))
        while i < len(actions):
            if actions[i].kind in COMMS:
                while i < len(actions) and actions[i].kind in COMMS:
                    start = self._clock()
                    self._comm(actions[i])
                    i += 1
                    if i == len(actions) or actions[i].kind not in COMMS:
                        assert self._messages is not None
                        self._messages.issue()  # the batch goes out with its last action
                    self._note(actions[i - 1], start)
                continue
            self._act(actions[i])
            i += 1
        if self._messages is not None:
            self._messages.finish()
        self._sum_ties()
        self.step_seconds = time.perf_counter() - self._step_began

    def _post_receives(self) -> None:
        """Post every receive of the step now, in the plan's order (gloo, ``Messages.early``).

        At its place in the plan a receive often comes after its peer's send (the plan orders
        actions, not times), and gloo then takes a round trip between the two ranks to
        deliver it (milliseconds on a loaded host, against tens of microseconds for a
        receive posted first). Posted at the step's start, every receive is there before its
        send; the computes keep the plan's order, and each waits for its input as before.
        """
        assert self._messages is not None
        receives = [a for a in self._actions if a.kind in (RECV_F, RECV_B)]
        for n, action in enumerate(receives, 1):
            start = self._clock()
            self._comm(action)
            if n == len(receives):
                self._messages.issue()  # the batch goes out with its last receive
            self._note(action, start)

    def _clock(self) -> float:
        return time.perf_counter() - self._step_began

    def _note(self, action: Action, start: float) -> None:
        """Record ``action`` from ``start`` to now, when recording."""
        if self.timeline is not None:
            self.timeline.append(TimedAction(action=action, start=start, end=self._clock()))

    def _fail(self, message: str, *, cause: bool = True) -> None:
        if self._failure is None:
            self._failure = Failure(message, cause)

    def _split_batch(self, inputs: tuple[Any, ...], target: Any) -> None:
        m = self.plan.microbatches
        self._mb_args = self._mb_targets = None
        try:
            if 0 in self._stages:
                if not inputs:
                    raise ValueError(
                        "the rank holding stage 0 got no inputs; call pipe.step(batch, "
                        "target=...) with the batch on that rank"
                    )
                chunks = [_split(x, m, "input") for x in inputs]
                self._mb_args = [tuple(c[i] for c in chunks) for i in range(m)]
            if self.plan.num_stages - 1 in self._stages:
                if target is None:
                    raise ValueError(
                        "the rank holding the last stage got no target; call pipe.step(..., "
                        "target=targets) on that rank"
                    )
                self._mb_targets = list(_split(target, m, "target"))
        except ValueError as e:
            self._fail(str(e))

    def _act(self, action: Action) -> None:
        kind = action.kind
        if kind == OVERLAP_F_B:
            for part in action.parts:
                self._act(part)
            return
        stage = self._stages[action.stage]
        if kind == REDUCE_GRAD:
            start = self._clock()
            self._reduce(stage)
            self._note(action, start)
        elif kind in (UNSHARD, RESHARD):
            start = self._clock()
            for module in stage.module.modules():
                if isinstance(module, ShardedModule):
                    if kind == UNSHARD:
                        module.unshard()
                    else:
                        module.reshard()
            self._note(action, start)
        elif self._failure is None:
            mb = action.microbatch
            assert mb is not None
            what = {
                FORWARD: "forward",
                FULL_BACKWARD: "backward",
                BACKWARD_INPUT: "input gradient",
                BACKWARD_WEIGHT: "weight gradient",
            }[kind]
            self._began = None
            try:
                if kind == FORWARD:
                    self._forward(stage, mb)
                elif kind == BACKWARD_WEIGHT:
                    self._weight(stage, mb)
                else:
                    self._backward(stage, mb, full=kind == FULL_BACKWARD)
                if self._began is not None:
                    self._note(action, self._began)
            except Exception as e:  # every rank must hear it: the step ends in one sentence
                self._fail(
                    f"stage {stage.index}'s {what} of microbatch {mb} raised "
                    f"{type(e).__name__}: {e}"
                )

    def _comm(self, action: Action) -> None:
        messages, stage, mb = self._messages, self._stages[action.stage], action.microbatch
        assert messages is not None and mb is not None
        kind = action.kind
        if kind == SEND_F:
            held = stage.fwd.get(mb)
            outputs = None if held is None or self._failure is not None else held[0]
            edge = stage.index + 1
            if outputs is not None and edge in messages.meta:
                got, agreed = metas_of(outputs), messages.meta[edge]
                if [(m.shape, m.dtype) for m in got] != [(m.shape, m.dtype) for m in agreed]:
                    self._fail(
                        f"stage {stage.index}'s output for microbatch {mb} is "
                        f"{describe_metas(got)} but stage {edge} receives "
                        f"{describe_metas(agreed)} (the shapes agreed at the first step); "
                        "give every microbatch of every step the same shapes"
                    )
                    outputs = None
            messages.send_forward(stage.index, mb, outputs)
        elif kind == SEND_B:
            grads = stage.grads_out.pop(mb, None)
            messages.send_backward(stage.index, mb, None if self._failure else grads)
        elif kind == RECV_F:
            messages.post_forward(stage.index, mb)
        elif kind == RECV_B:
            messages.post_backward(stage.index, mb)

    def _begin(self) -> None:
        """The compute starts: its input is here (what came before was waiting)."""
        if self.timeline is not None:
            self._began = self._clock()

    def _forward(self, stage: _Stage, mb: int) -> None:
        if stage.first:
            assert self._mb_args is not None
            args = self._mb_args[mb]
        elif stage.prev_local:
            args = stage.inputs_in.pop(mb)
        else:
            assert self._messages is not None
            got = self._messages.wait("F", stage.index, mb)
            if got is None:
                self._fail(f"stage {stage.index} received no input", cause=False)
                return
            args = tuple(got)
        self._begin()
        out = stage.module(*args)
        outputs = out if isinstance(out, tuple) else (out,)
        if not all(isinstance(t, torch.Tensor) for t in outputs):
            raise TypeError("a stage returns a tensor or a tuple of tensors")
        if stage.last:
            assert self._mb_targets is not None
            stage.losses[mb] = self.loss_fn(out, self._mb_targets[mb])
        stage.fwd[mb] = (outputs, args)
        self._live += 1
        self.peak_stash = max(self.peak_stash, self._live)
        if stage.next_local:
            # A new leaf for the next stage's graph, as torch's set_local_fwd_input.
            self._stages[stage.index + 1].inputs_in[mb] = tuple(
                t.detach().requires_grad_(t.requires_grad) for t in outputs
            )

    def _output_grads(self, stage: _Stage, mb: int) -> tuple[Any, ...] | None:
        """What the backward starts from: ``(outputs, their gradients)``, or ``None`` when the
        next stage's rank failed and sent nothing."""
        if stage.next_local:
            return stage.grads_in.pop(mb)
        assert self._messages is not None
        got = self._messages.wait("B", stage.index + 1, mb)
        if got is None:
            return None
        metas = self._messages.meta[stage.index + 1]
        received = iter(got)
        return tuple(next(received) if m.has_grad else None for m in metas)

    def _backward(self, stage: _Stage, mb: int, *, full: bool) -> None:
        outputs, inputs = stage.fwd[mb]
        if stage.last:
            outs: tuple[torch.Tensor, ...] = (stage.losses[mb],)
            grads = None
        else:
            grads = self._output_grads(stage, mb)
            if grads is None:
                self._fail(f"stage {stage.index} received no output gradient", cause=False)
                return
            outs = outputs
        self._begin()
        del stage.fwd[mb]
        if full:
            self._set_sync(stage)
            with stage.order.microbatch(mb):
                dinputs = full_backward(outs, grads, inputs)
            stage.backwards += 1
            self._live -= 1
        else:
            split = SplitBackward(stage.module, outs, grads, inputs, first=stage.first)
            dinputs = split.input_half()
            stage.split[mb] = split
        if stage.first:
            return
        if stage.prev_local:
            self._stages[stage.index - 1].grads_in[mb] = dinputs
        else:
            stage.grads_out[mb] = dinputs

    def _weight(self, stage: _Stage, mb: int) -> None:
        split = stage.split.pop(mb)
        self._begin()
        with stage.order.microbatch(mb):
            split.weight_half()
        stage.backwards += 1
        self._live -= 1

    def _set_sync(self, stage: _Stage) -> None:
        """fully_shard: accumulate unsharded, reduce-scatter in the stage's last backward
        (FSDP2's gradient accumulation), whose end is the plan's REDUCE_GRAD."""
        if stage.kind == "sharded":
            last = stage.backwards == self.plan.microbatches - 1
            stage.module.set_requires_gradient_sync(last)  # type: ignore[operator]

    def _reduce(self, stage: _Stage) -> None:
        """``REDUCE_GRAD``: the stage's gradients are final. Data parallelism reduces them
        (run in a failed step too: the data-parallel peers are in it), then the scale."""
        if stage.kind == "dp":
            try:
                stage.module.sync_gradients()  # type: ignore[operator]
            except Exception as e:  # second to a stage that raised: its peers then differ
                self._fail(f"stage {stage.index}'s data-parallel reduction raised {e}", cause=False)
        if self.scale_grads and self.plan.microbatches != 1:
            with torch.no_grad():
                for p in stage.module.parameters():
                    if p.grad is not None:
                        p.grad.div_(self.plan.microbatches)

    def _sum_ties(self) -> None:
        """Each tied weight's two gradients summed, both copies given the sum."""
        for pa, pb, group in self._ties:
            with torch.no_grad():
                if group is None:
                    if pa is None or pb is None:
                        continue  # neither copy is here
                    total = _grad(pa) + _grad(pb)
                    pa.grad, pb.grad = total, total.clone()
                    continue
                mine = pa if pa is not None else pb
                assert mine is not None
                grad = _grad(mine)
                dist.all_reduce(grad, group=group)
                mine.grad = grad


def _grad(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _split(x: Any, m: int, what: str) -> Sequence[torch.Tensor]:
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"the {what} must be a tensor, got {type(x).__name__}")
    rows = x.shape[0] if x.dim() else 0
    if rows % m or rows == 0:
        raise ValueError(
            f"the {what} has {rows} rows, which do not split into {m} equal microbatches; "
            f"give a multiple of {m}"
        )
    return torch.tensor_split(x, m, dim=0)
