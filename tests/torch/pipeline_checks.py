"""Checks of gradsync_torch's pipeline executor that run inside spawned gloo ranks.

``test_pipeline.py`` spawns one group of ranks per world size and runs the checks here in it.
The model is ``examples/pipeline_models.gpt_blocks``: a GPT of 8 layers, width 16, trained 4
steps (SGD; the loss is the mean over a microbatch's tokens). References:

- torch's ``torch.distributed.pipelining`` with the same schedule and the same stage modules
  (``PipelineStage``, ``Schedule*``): bitwise, except looped BFS, whose backwards run in
  reverse microbatch order and so sum the gradients in another order (docs/design.md §17);
- the unpipelined model with the same microbatch accumulation (each microbatch's loss
  backward in turn, then the gradients divided by the microbatches): bitwise too, since
  gradsync adds microbatch gradients in microbatch order under every schedule;
- under data parallelism, ZeRO-3 or a tied weight, the unpipelined model trained on every
  rank's batch: within ``TOL`` (the data-parallel mean and the tied sum add in another
  order: a few float32 ulps after 4 steps).

This module holds no tests of its own.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

from examples.pipeline_models import gpt_blocks, lm_loss, token_batch
from gradsync_core import SCHEDULES, PipelinePlan, Topology, plan_pipeline
from gradsync_core.plan.pipeline import RECV_B, RECV_F
from gradsync_torch import DataParallel, ProcessGroups, fully_shard
from gradsync_torch.pipeline import Pipeline, split_model
from tests.support.asserts import assert_tensors_close

TOL = {"rtol": 1e-5, "atol": 1e-6}  # fp32, sums in another order (data parallel, tied)
STEPS = 4
LR = 0.1
SEQ, VOCAB = 8, 32
TORCH = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "LoopedBFS": torch_schedules.ScheduleLoopedBFS,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
    "ZBVZeroBubble": torch_schedules.ScheduleZBVZeroBubble,
    "DualPipeV": torch_schedules.ScheduleDualPipeV,
}
SINGLE = ("GPipe", "1F1B")


def plan_for(
    name: str, topology: Topology, microbatches: int, *, layers: int = 8, zero3: bool = False
) -> PipelinePlan:
    """The schedule with 1 stage per rank (GPipe, 1F1B) or 2 (the others)."""
    v = 1 if name in SINGLE else 2
    return plan_pipeline(
        schedule=name,
        microbatches=microbatches,
        topology=topology,
        layers=layers,
        stages_per_rank=v,
        zero3=zero3,
    )


def batches(rows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One batch of ``rows`` sequences per step, the same on every rank."""
    return [token_batch(rows, SEQ, VOCAB, seed=100 + step) for step in range(STEPS)]


def train_pipeline(
    pipe: Pipeline, data: Sequence[tuple[torch.Tensor, torch.Tensor]]
) -> list[list[torch.Tensor] | None]:
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    losses = []
    for x, y in data:
        losses.append(pipe.step(x, target=y))
        opt.step()
        opt.zero_grad()
    return losses


def train_torch(
    name: str,
    plan: PipelinePlan,
    stages: dict[int, nn.Module],
    group: Any,
    data: Sequence[tuple[torch.Tensor, torch.Tensor]],
) -> list[list[torch.Tensor]]:
    """The same stages under torch's schedule of the same name."""
    built = [
        PipelineStage(module, s, plan.num_stages, torch.device("cpu"), group=group)
        for s, module in sorted(stages.items())
    ]
    cls = TORCH[name]
    schedule = cls(built[0] if name in SINGLE else built, plan.microbatches, loss_fn=lm_loss)
    opt = torch.optim.SGD([p for m in stages.values() for p in m.parameters()], lr=LR)
    out = []
    for x, y in data:
        losses: list[torch.Tensor] = []
        args = (x,) if 0 in stages else ()
        kwargs = {"target": y, "losses": losses} if plan.num_stages - 1 in stages else {}
        schedule.step(*args, **kwargs)
        opt.step()
        opt.zero_grad()
        out.append(losses)
    return out


def train_reference(
    blocks: nn.Module, data: Sequence[tuple[torch.Tensor, torch.Tensor]], microbatches: int
) -> nn.Module:
    """The unpipelined model, each microbatch's backward in turn, the sum divided by the
    microbatches (torch's scale_grads); ``data`` may hold several data-parallel ranks'
    batches per step (a list per step), averaged after."""
    model = copy.deepcopy(blocks)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in data:
        replicas = step if isinstance(step, list) else [step]
        for x, y in replicas:
            for xm, ym in zip(
                x.tensor_split(microbatches), y.tensor_split(microbatches), strict=True
            ):
                lm_loss(model(xm), ym).backward()
        with torch.no_grad():
            for p in model.parameters():
                p.grad.div_(microbatches * len(replicas))
        opt.step()
        opt.zero_grad()
    return model


def held(stages: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    """This rank's parameters by model name (wrappers and shards resolved)."""
    out = {}
    for module in stages.values():
        inner = module.module if isinstance(module, DataParallel) else module
        for name, p in inner.named_parameters():
            out[name] = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
    return out


def assert_bitwise(mine: dict[str, torch.Tensor], theirs: dict[str, torch.Tensor], what: str):
    for name, p in mine.items():
        assert torch.equal(p, theirs[name]), (
            f"{what}: {name} differs by {(p - theirs[name]).abs().max().item():.3g}"
        )


# ---- exactness ---------------------------------------------------------------------------


def check_schedules_equal_torch(rank: int, ws: int, names: Sequence[str] = SCHEDULES) -> None:
    """Every schedule at pp = ws: bitwise torch's pipelining (looped BFS: within the floor)
    and bitwise the unpipelined model; the peak stash is the plan's."""
    topology = Topology.create(ws, pp=ws)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks()
    data = batches(8)
    reference = dict(train_reference(blocks, data, 2 * ws).named_parameters())
    for name in names:
        plan = plan_for(name, topology, 2 * ws)
        split = split_model(blocks, plan, groups.group_rank("pp"))
        theirs = {s: copy.deepcopy(m) for s, m in split.stages.items()}
        pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss)
        losses = train_pipeline(pipe, data)
        torch_losses = train_torch(name, plan, theirs, groups["pp"].process_group, data)
        mine = held(split.stages)
        assert_bitwise(mine, reference, f"{name} vs the unpipelined model")
        if name == "LoopedBFS":  # torch sums its microbatches backwards
            assert_tensors_close(mine, held(theirs), f"{name} vs torch", **TOL)
        else:
            assert_bitwise(mine, held(theirs), f"{name} vs torch")
            if losses[0] is not None:
                assert all(
                    torch.equal(a, b) for a, b in zip(losses[-1], torch_losses[-1], strict=True)
                ), name
        assert pipe.peak_stash == plan.peak_stash[groups.group_rank("pp")], (name, pipe.peak_stash)


def check_timeline(rank: int, ws: int) -> None:
    """With ``pipe.timeline = []`` a step records every action of this rank's plan (an
    overlapped pair as its two halves), each from its start to its end after the previous
    one's end: computes, sends and receives, and REDUCE_GRAD, as the simulator's timeline has
    them (benchmarks/torch_pipeline.py compares the two). On gloo every receive is posted at
    the step's start, in the plan's order, before any compute (a gloo receive posted after its
    send costs a round trip); the other actions follow in the plan's order."""
    topology = Topology.create(ws, pp=ws)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks()
    x, y = batches(8)[0]
    for name in ("1F1B", "InterleavedZeroBubble", "DualPipeV"):
        plan = plan_for(name, topology, 2 * ws)
        pipe = Pipeline(
            plan,
            split_model(blocks, plan, groups.group_rank("pp")).stages,
            groups=groups,
            loss_fn=lm_loss,
        )
        actions = [leaf for a in plan.actions[groups.group_rank("pp")] for leaf in a.leaves]
        receives = [a for a in actions if a.kind in (RECV_F, RECV_B)]
        want = receives + [a for a in actions if a not in receives]
        for _ in range(2):  # the first step agrees on the shapes, the second knows them
            pipe.timeline = []
            pipe.step(x, target=y)
            assert [t.action for t in pipe.timeline] == want, (name, pipe.timeline)
        assert all(0 <= t.start <= t.end <= pipe.step_seconds for t in pipe.timeline), name
        ends = [t.end for t in pipe.timeline]
        assert all(t.start >= end for t, end in zip(pipe.timeline[1:], ends, strict=False)), name


def check_tied_embedding(rank: int, ws: int) -> None:
    """The token embedding tied to the output layer, across the first and last stage (on two
    ranks under 1F1B, on one under ZBV): equal to the unpipelined tied model."""
    topology = Topology.create(ws, pp=ws)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks(tied=True)
    data = batches(8)
    reference = dict(train_reference(blocks, data, 2 * ws).named_parameters())
    for name in ("1F1B", "ZBVZeroBubble"):
        plan = plan_for(name, topology, 2 * ws)
        split = split_model(blocks, plan, groups.group_rank("pp"))
        assert split.tied == (("0.token.weight", f"{len(blocks) - 1}.out.weight"),), split.tied
        pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss, tied=split.tied)
        train_pipeline(pipe, data)
        mine = held(split.stages)
        if f"{len(blocks) - 1}.out.weight" in mine:  # the unpipelined model names it once
            mine["0.token.weight.out"] = mine.pop(f"{len(blocks) - 1}.out.weight")
            reference["0.token.weight.out"] = reference["0.token.weight"]
        assert_tensors_close(mine, reference, f"{name}, tied", **TOL)
        # Untied, the same run ends elsewhere: the sum is what makes it equal.
        if name == "1F1B":
            loose = split_model(blocks, plan, groups.group_rank("pp"))
            pipe = Pipeline(plan, loose.stages, groups=groups, loss_fn=lm_loss)
            train_pipeline(pipe, data)
            token = held(loose.stages).get("0.token.weight")
            if token is not None:
                assert not torch.allclose(token, reference["0.token.weight"], **TOL)


def _dp_data(ws_dp: int, dp_rank: int) -> tuple[list, list]:
    """This dp rank's batches, and every dp rank's for the reference."""
    every = [
        [token_batch(4, SEQ, VOCAB, seed=1000 * s + d) for d in range(ws_dp)] for s in range(STEPS)
    ]
    return [step[dp_rank] for step in every], every


def check_data_parallel(rank: int, ws: int) -> None:
    """dp 2 x pp 2, stages in DataParallel(overlap=False): 1F1B and ZB1P equal the
    unpipelined data-parallel run (every rank's batch) within the floor."""
    topology = Topology.create(ws, pp=2)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks()
    mine_data, every = _dp_data(topology.dp, groups.group_rank("dp"))
    reference = dict(train_reference(blocks, every, 2).named_parameters())
    for name in ("1F1B", "InterleavedZeroBubble"):
        plan = plan_for(name, topology, 2)
        split = split_model(blocks, plan, groups.group_rank("pp"))
        stages = {
            s: DataParallel(m, process_group=groups["dp"].process_group, overlap=False)
            for s, m in split.stages.items()
        }
        pipe = Pipeline(plan, stages, groups=groups, loss_fn=lm_loss)
        train_pipeline(pipe, mine_data)
        assert_tensors_close(held(stages), reference, f"dp 2 x pp 2, {name}", **TOL)
    # A stage that raises on rank 3 (pipeline 1, stage 1): its pipeline peer and its
    # data-parallel peer (rank 1, whose reduction now sees another history) end the step with
    # rank 3's sentence, and so does the other pipeline.
    plan = plan_for("1F1B", topology, 4)
    split = split_model(blocks, plan, groups.group_rank("pp"))
    if rank == 3:
        make_unlucky(split.stages[1].get_submodule(split.stages[1].block_names[0]), 2)
    dp = groups["dp"].process_group
    stages = {s: DataParallel(m, process_group=dp, overlap=False) for s, m in split.stages.items()}
    pipe = Pipeline(plan, stages, groups=groups, loss_fn=lm_loss)
    x, y = mine_data[0]
    _raises(
        RuntimeError,
        lambda: pipe.step(x, target=y),
        "failed on rank 3: stage 1's forward of microbatch 1 raised FloatingPointError",
    )


def check_zero3(rank: int, ws: int) -> None:
    """ZeRO-3 (fully_shard over dp 2) x pp 2, GPipe and interleaved 1F1B with UNSHARD and
    RESHARD planned: equal to the unpipelined data-parallel run within the floor."""
    topology = Topology.create(ws, pp=2)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks()
    mine_data, every = _dp_data(topology.dp, groups.group_rank("dp"))
    reference = dict(train_reference(blocks, every, 2).named_parameters())
    dp = groups["dp"].process_group
    for name in ("GPipe", "Interleaved1F1B"):
        plan = plan_for(name, topology, 2, zero3=True)
        split = split_model(blocks, plan, groups.group_rank("pp"))
        for stage in split.stages.values():
            for block in stage.block_names:
                fully_shard(stage.get_submodule(block), process_group=dp)
            fully_shard(stage, process_group=dp)
        pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss)
        train_pipeline(pipe, mine_data)
        assert_tensors_close(held(split.stages), reference, f"ZeRO-3 x pp 2, {name}", **TOL)


def check_tensor_parallel(rank: int, ws: int) -> None:
    """tp 2 x pp 2: stages of column/row-parallel blocks over the topology's tp group equal
    the serial model's shards within the floor (the tp all-reduce sums in another order)."""
    from examples.tp_models import MLPBlock, ParallelMLPBlock
    from gradsync_torch import local_state

    topology = Topology.create(ws, tp=2, pp=2)
    groups = ProcessGroups(topology)
    torch.manual_seed(0)
    d, layers = 8, 8
    serial = nn.Sequential(
        nn.Linear(d, d), *(MLPBlock(d, 2 * d) for _ in range(layers)), nn.LayerNorm(d)
    )
    parallel = nn.Sequential(
        nn.Linear(d, d),
        *(ParallelMLPBlock(d, 2 * d, groups["tp"]) for _ in range(layers)),
        nn.LayerNorm(d),
    )
    parallel.load_state_dict(local_state(parallel, serial.state_dict()))
    gen = torch.Generator().manual_seed(3)
    data = [
        (torch.randn(4, 3, d, generator=gen), torch.randn(4, 3, d, generator=gen))
        for _ in range(STEPS)
    ]

    def mse(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return (out - target).square().mean()

    plan = plan_for("1F1B", topology, 2, layers=layers)
    split = split_model(parallel, plan, groups.group_rank("pp"))
    pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=mse)
    opt = torch.optim.SGD(pipe.parameters(), lr=LR)
    ref_opt = torch.optim.SGD(serial.parameters(), lr=LR)
    for x, y in data:
        pipe.step(x, target=y)
        opt.step()
        opt.zero_grad()
        for xm, ym in zip(x.tensor_split(2), y.tensor_split(2), strict=True):
            mse(serial(xm), ym).backward()
        for p in serial.parameters():
            p.grad.div_(2)
        ref_opt.step()
        ref_opt.zero_grad()
    for stage in split.stages.values():
        want = local_state(stage, {k: v for k, v in serial.state_dict().items()})
        assert_tensors_close(dict(stage.named_parameters()), want, "tp 2 x pp 2", **TOL)


# ---- refusals and failures -----------------------------------------------------------------


def _same_everywhere(error: BaseException) -> str:
    message = str(error)
    sentences: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(sentences, message)
    assert all(s == message for s in sentences), sentences
    return message


def _raises(kind: type[BaseException], fn: Callable[[], Any], *needles: str) -> str:
    try:
        fn()
    except kind as error:
        message = _same_everywhere(error)
        for needle in needles:
            assert needle in message, (needle, message)
        return message
    raise AssertionError(f"{kind.__name__} not raised")


def check_refusals(rank: int, ws: int) -> None:
    """Different plans, stages other than the plan's, a plan for another pp: one sentence on
    every rank at construction, before any message."""
    topology = Topology.create(ws, pp=ws)
    groups = ProcessGroups(topology)
    blocks = gpt_blocks()
    pp_rank = groups.group_rank("pp")
    # Rank 1 plans 1F1B, the others GPipe.
    plan = plan_for("1F1B" if rank == 1 else "GPipe", topology, 4)
    stages = split_model(blocks, plan, pp_rank).stages
    _raises(
        ValueError,
        lambda: Pipeline(plan, stages, groups=groups, loss_fn=lm_loss),
        "different pipelines",
        "rank 0 runs GPipe",
        "rank 1 runs 1F1B",
    )
    # Rank 0 is given the stages of an interleaved plan (two per rank).
    plan = plan_for("GPipe", topology, 4)
    interleaved = plan_for("Interleaved1F1B", topology, 4)
    given = split_model(blocks, interleaved if rank == 0 else plan, pp_rank).stages
    _raises(
        ValueError,
        lambda: Pipeline(plan, given, groups=groups, loss_fn=lm_loss),
        "(rank 0): pipeline rank 0 holds stages [0] of the plan",
        "was given modules for stages [0, 2]",
    )
    # A plan for one pipeline rank on a pipeline group of ws.
    alone = plan_pipeline(schedule="GPipe", microbatches=4, topology=Topology(pp=1), layers=8)
    _raises(
        ValueError,
        lambda: Pipeline(
            alone, split_model(blocks, alone, 0).stages, groups=groups, loss_fn=lm_loss
        ),
        "the plan is for",
        "(pp = 1) but the process groups are for",
    )
    stages = split_model(blocks, plan, pp_rank).stages
    alone_groups = [dist.new_group([r]) for r in range(ws)]  # dp 1: a group of one each
    _raises(
        ValueError,
        lambda: Pipeline(
            plan,
            {s: DataParallel(m, process_group=alone_groups[rank]) for s, m in stages.items()},
            groups=groups,
            loss_fn=lm_loss,
        ),
        "overlap=False",
    )


def make_unlucky(block: nn.Module, fail_at: int) -> None:
    """Make ``block`` raise on its ``fail_at``-th call (its names and weights unchanged)."""
    calls = [0]

    def hook(module: nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] == fail_at:
            raise FloatingPointError("the block's activations overflowed")

    block.register_forward_pre_hook(hook)


def check_failures(rank: int, ws: int) -> None:
    """A stage that raises on one rank, a stage whose output changes shape: every rank ends
    the step with the failed rank's sentence, none waits in a receive."""
    topology = Topology.create(ws, pp=ws)
    groups = ProcessGroups(topology)
    pp_rank = groups.group_rank("pp")
    for name, fail_at in (("1F1B", 1), ("InterleavedZeroBubble", 3), ("GPipe", 7)):
        blocks = gpt_blocks()
        plan = plan_for(name, topology, 4)
        split = split_model(blocks, plan, pp_rank)
        if rank == 1:  # raise in the middle of the step on rank 1 (the 2nd step for GPipe)
            stage = split.stages[min(split.stages)]
            make_unlucky(stage.get_submodule(stage.block_names[0]), fail_at)
        pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss)
        data = batches(8)
        if fail_at > 4:
            pipe.step(data[0][0], target=data[0][1])
        _raises(
            RuntimeError,
            lambda p=pipe, d=data: p.step(d[1][0], target=d[1][1]),
            "failed on rank 1",
            "FloatingPointError: the block's activations overflowed",
        )
        _raises(
            RuntimeError,
            lambda p=pipe, d=data: p.step(d[2][0], target=d[2][1]),
            "failed in an earlier step",
        )
    # Stage 1 built for width 8 receives stage 0's width 16: its forward raises, once.
    from examples.pipeline_models import Layer

    plan = plan_for("1F1B", topology, 4)
    blocks = gpt_blocks()
    blocks[5] = Layer(8, 2)  # the first block of stage 1 ('Et*4|t*4L')
    pipe = Pipeline(plan, split_model(blocks, plan, pp_rank).stages, groups=groups, loss_fn=lm_loss)
    x, y = token_batch(8, SEQ, VOCAB, seed=0)
    _raises(
        RuntimeError,
        lambda: pipe.step(x, target=y),
        "failed on rank 1: stage 1's forward of microbatch 0 raised RuntimeError",
    )
    # A rank that gets no batch.
    plan = plan_for("GPipe", topology, 4)
    pipe = Pipeline(
        plan, split_model(gpt_blocks(), plan, pp_rank).stages, groups=groups, loss_fn=lm_loss
    )
    _raises(
        RuntimeError,
        lambda: pipe.step(),
        "failed on rank 0: the rank holding stage 0 got no inputs",
    )
    # The same pipeline given longer sequences at its second step: stage 0's output is not
    # the shape stage 1 agreed to receive.
    plan = plan_for("1F1B", topology, 4)
    split = split_model(gpt_blocks(seq=16), plan, pp_rank)
    pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss)
    x, y = token_batch(8, SEQ, VOCAB, seed=0)
    pipe.step(x, target=y)
    x, y = token_batch(8, 2 * SEQ, VOCAB, seed=1)
    _raises(
        RuntimeError,
        lambda: pipe.step(x, target=y),
        "failed on rank 0",
        "stage 0's output for microbatch 0 is (2, 16, 16) float32 but stage 1 receives "
        "(2, 8, 16) float32",
    )


# ---- checkpoints -----------------------------------------------------------------------------


def _everything(pipe: Pipeline, opt: torch.optim.Optimizer) -> dict[str, Any]:
    """Every stage's weights and optimizer state by model name, on every rank."""
    mine = {}
    for module in pipe.stages.values():
        inner = module.module if isinstance(module, DataParallel) else module
        for name, p in inner.named_parameters():
            state = {
                k: v.full_tensor() if hasattr(v, "full_tensor") else v
                for k, v in opt.state.get(p, {}).items()
            }
            mine[name] = (p.full_tensor() if hasattr(p, "full_tensor") else p.detach(), state)
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return {k: v for part in every for k, v in part.items()}


def _same(got: dict[str, Any], want: dict[str, Any], alias: dict[str, str], what: str) -> None:
    for name, (weight, state) in got.items():
        ref_weight, ref_state = want[alias.get(name, name)]
        assert torch.equal(weight, ref_weight), f"{what}: weight {name}"
        assert state.keys() == ref_state.keys(), (what, name, state.keys(), ref_state.keys())
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(ref_state[key])), (
                f"{what}: {key} of {name}"
            )


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def check_checkpoint(rank: int, ws: int, directory: str) -> None:
    """A checkpoint saved at dp 2 x pp 2 (a tied embedding; AdamW) loads, weights and
    optimizer state bitwise, at pp 4 and into the unpipelined model (pp 1) on every rank; one
    saved without the tie loads into ZeRO-3 x pp 2 stages. ``test_pipeline.py`` then loads
    the first in JAX."""
    from gradsync_torch import load_model_weights, load_optimizer_state_dict
    from gradsync_torch.pipeline import load_pipeline, save_pipeline

    topology = Topology.create(ws, pp=2)
    groups = ProcessGroups(topology)
    mine_data, _ = _dp_data(topology.dp, groups.group_rank("dp"))
    for tied in (True, False):
        blocks = gpt_blocks(tied=tied)
        plan = plan_for("1F1B", topology, 2)
        split = split_model(blocks, plan, groups.group_rank("pp"))
        dp = groups["dp"].process_group
        stages = {
            s: DataParallel(m, process_group=dp, overlap=False) for s, m in split.stages.items()
        }
        pipe = Pipeline(plan, stages, groups=groups, loss_fn=lm_loss, tied=split.tied)
        opt = _adamw(pipe.parameters())
        for x, y in mine_data[:2]:
            pipe.step(x, target=y)
            opt.step()
            opt.zero_grad()
        saved = _everything(pipe, opt)
        path = f"{directory}/{'tied' if tied else 'untied'}"
        save_pipeline(path, pipe, opt)
        alias = {b: a for a, b in split.tied}
        fresh = gpt_blocks(tied=tied, seed=1)  # other weights: the load must replace them
        if tied:
            # pp 4 (dp 1), interleaved: other stages on other ranks.
            wide = Topology.create(ws, pp=4)
            wide_groups = ProcessGroups(wide)
            wide_plan = plan_for("Interleaved1F1B", wide, 4)
            wide_split = split_model(fresh, wide_plan, wide_groups.group_rank("pp"))
            other = Pipeline(
                wide_plan,
                wide_split.stages,
                groups=wide_groups,
                loss_fn=lm_loss,
                tied=wide_split.tied,
            )
            other_opt = _adamw(other.parameters())
            load_pipeline(path, other, other_opt)
            _same(_everything(other, other_opt), saved, alias, "pp 4")
            # pp 1: the unpipelined model and a plain optimizer, on every rank.
            model = copy.deepcopy(fresh)
            plain = _adamw(model.parameters())
            load_model_weights(path, model)
            load_optimizer_state_dict(path, plain, model)
            for name, p in model.named_parameters():
                assert torch.equal(p, saved[name][0]), f"pp 1: {name}"
                for key, value in plain.state[p].items():
                    assert torch.equal(torch.as_tensor(value), torch.as_tensor(saved[name][1][key]))
        else:
            zplan = plan_for("1F1B", topology, 2, zero3=True)
            zsplit = split_model(fresh, zplan, groups.group_rank("pp"))
            for stage in zsplit.stages.values():
                fully_shard(stage, process_group=dp)
            other = Pipeline(zplan, zsplit.stages, groups=groups, loss_fn=lm_loss)
            other_opt = _adamw(other.parameters())
            for x, y in mine_data[:1]:  # states exist before the load, as in a resumed run
                other.step(x, target=y)
                other_opt.step()
                other_opt.zero_grad()
            load_pipeline(path, other, other_opt)
            _same(_everything(other, other_opt), saved, {}, "ZeRO-3 x pp 2")
    # A checkpoint of another model is refused on every rank, nothing loaded.
    small = split_model(gpt_blocks(layers=8, width=8), plan, groups.group_rank("pp"))
    pipe = Pipeline(plan, small.stages, groups=groups, loss_fn=lm_loss)
    before = {k: v.clone() for k, v in held(small.stages).items()}
    _raises(
        ValueError,
        lambda: load_pipeline(f"{directory}/untied", pipe),
        "cannot load",
        "another model?",
    )
    assert_bitwise(held(small.stages), before, "a refused load changes nothing")
