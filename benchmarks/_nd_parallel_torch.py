"""The torch half of benchmarks/nd_parallel.py: gradsync's composition against torch's own.

Both run in the same 8 gloo ranks, alternating step by step, on the same Llama (the same
seed: the same weights), the same batches and the same step: forward and backward of the
global batch, the gradients clipped by the whole model's 2-norm, AdamW, ``zero_grad``.

- gradsync: ``examples/llama_torch.parallelize`` (its tensor/sequence-parallel layers,
  ``Pipeline``, ``fully_shard``, the derived shared-gradient sums, its clip).
- torch: torchtitan's recipe on torch's public pieces. One ``init_device_mesh`` of
  ``(pp, [dp_replicate,] dp_shard, tp)`` (slowest first, as torchtitan's ``ParallelDims``
  and as gradsync's ``Topology`` order the ranks); the model split into the same stages
  (``Llama.stage``, torchtitan's ``pipeline_module_split``); on each stage torchtitan's
  ``apply_tp`` plan (``parallelize_module``: ``tok_embeddings`` ``RowwiseParallel`` to
  ``Shard(1)``, the norms ``SequenceParallel``, ``PrepareModuleInput`` before attention and
  the MLP, ``wq``/``wk``/``wv``/``w1``/``w3`` ``ColwiseParallel``, ``wo``/``w2``
  ``RowwiseParallel`` to ``Shard(1)``, ``output`` ``ColwiseParallel`` from ``Shard(1)`` to
  logits split over the vocabulary, the loss under ``loss_parallel``: torchtitan's default
  loss parallelism); then FSDP2's ``fully_shard`` on every layer and on the stage
  (gradsync's units; torchtitan also wraps the embedding and the norm with the output
  apart), ``reshard_after_forward`` as torchtitan defaults it (not under pp, where each
  microbatch's forward would gather the layers again; gradsync's ``Pipeline`` gathers a
  stage's units at its plan's ``UNSHARD``, torch's lowering of ZeRO-3 stages); HSDP on the 2-D
  ``(dp_replicate, dp_shard)`` mesh; ``PipelineStage`` and ``Schedule1F1B``/
  ``ScheduleGPipe`` with the same microbatches (``scale_grads``: the mean over them); the
  clip is torchtitan's ``dist_utils.clip_grad_norm_`` (the DTensor norm, its square summed
  over ``pp``).

Every rank returns its figures; rank 0 puts them all on the queue.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard as fsdp2
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining.schedules import Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)
from zero3_memory import peak_live_bytes

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, lm_loss_share, local_state, parallelize
from gradsync_core import Topology

LR, WEIGHT_DECAY, MAX_NORM = 1e-3, 0.1, 1.0
TORCH_SCHEDULES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe}
GRADSYNC, TORCH = "gradsync", "torch"


def topology_of(sizes: dict[str, int], world: int) -> Topology:
    """The ``Topology`` of a configuration's sizes (``dp_replicate`` is what is left)."""
    return Topology.create(
        world, tp=sizes.get("tp", 1), pp=sizes.get("pp", 1), dp_shard=sizes["dp_shard"]
    )


def _whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _storage_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local pieces)."""
    storages = {}
    for t in tensors:
        storage = _local(t).untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


class _Gradsync:
    """``examples/llama_torch.parallelize`` and AdamW over its parameters."""

    def __init__(
        self, config: LlamaConfig, topology: Topology, options: ParallelOptions, seq: int
    ) -> None:
        self.par = parallelize(Llama(config), topology, options, seq_len=seq)
        self.opt = torch.optim.AdamW(list(self.par.parameters()), lr=LR, weight_decay=WEIGHT_DECAY)
        groups = self.par.groups
        # The ranks whose loss shares add up to their replica's loss (llama_nd.py's rule).
        self.counts = self.par.has_last_stage and (
            options.sequence_parallel or groups.group_rank("tp") == 0
        )
        self.modules: list[nn.Module] = list(self.par.parts)

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        loss = self.par.step(tokens, targets)
        self.par.clip_grad_norm_(MAX_NORM)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss if self.counts else None

    def backward_only(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self.par.step(tokens, targets)


def _tp_plan(stage: Llama, tp_mesh: DeviceMesh) -> None:
    """torchtitan's ``apply_tp`` on one stage."""
    top: dict[str, Any] = {}
    if stage.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1))
    if stage.norm is not None:
        top["norm"] = SequenceParallel()
    if stage.output is not None:
        # Loss parallelism (torchtitan's default): the logits stay split over the vocabulary
        # and ``loss_parallel``'s cross-entropy reduces over tp.
        top["output"] = ColwiseParallel(
            input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False
        )
    if top:
        parallelize_module(stage, tp_mesh, top)
    for block in stage.blocks():
        parallelize_module(
            block,
            tp_mesh,
            {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "attention.wq": ColwiseParallel(),
                "attention.wk": ColwiseParallel(),
                "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
                ),
                "feed_forward.w1": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel(),
            },
        )


class _Torch:
    """torch's composition, torchtitan's recipe (see the module docstring)."""

    def __init__(
        self, config: LlamaConfig, topology: Topology, options: ParallelOptions, seq: int
    ) -> None:
        names = ["pp", "dp_replicate", "dp_shard", "tp"]
        shape = [topology.pp, topology.dp_replicate, topology.dp_shard, topology.tp]
        keep = [i for i, n in enumerate(names) if shape[i] > 1 or n == "dp_shard"]
        mesh = init_device_mesh(
            "cpu", tuple(shape[i] for i in keep), mesh_dim_names=tuple(names[i] for i in keep)
        )
        self.topology, self.seq = topology, seq
        dp_names = ("dp_replicate", "dp_shard") if topology.hsdp else ("dp_shard",)
        dp_mesh = mesh[dp_names]
        coords = {n: mesh.get_local_rank(n) for n in mesh.mesh_dim_names or ()}
        self.dp_rank = coords.get("dp_replicate", 0) * topology.dp_shard + coords["dp_shard"]
        self.pp_rank = coords.get("pp", 0)
        self.pp_group = mesh["pp"].get_group() if topology.pp > 1 else None
        model = Llama(config)
        per_stage = config.n_layers // topology.pp
        first_layer = self.pp_rank * per_stage
        layers = [str(i) for i in range(first_layer, first_layer + per_stage)]
        last = self.pp_rank == topology.pp - 1
        stage = model.stage(layers, first=self.pp_rank == 0, last=last)
        if topology.tp > 1:
            _tp_plan(stage, mesh["tp"])
        # torchtitan's default: under pp no reshard after forward (each microbatch's forward
        # would gather the layers again).
        reshard = options.reshard_after_forward and topology.pp == 1
        for block in stage.blocks():
            fsdp2(block, mesh=dp_mesh, reshard_after_forward=reshard)
        fsdp2(stage, mesh=dp_mesh, reshard_after_forward=reshard)
        self.stage, self.first, self.last = stage, self.pp_rank == 0, last
        self.modules: list[nn.Module] = [stage]
        self.schedule = None
        if topology.pp > 1:
            built = PipelineStage(
                stage, self.pp_rank, topology.pp, torch.device("cpu"), group=self.pp_group
            )
            cls = TORCH_SCHEDULES[options.schedule]
            self.schedule = cls(built, options.microbatches, loss_fn=self.loss_fn)
        self.opt = torch.optim.AdamW(stage.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        self.counts = last and coords.get("tp", 0) == 0  # every tp rank has the whole loss

    @staticmethod
    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The mean next-token cross-entropy of a (micro)batch; under tp the logits are a
        DTensor split over the vocabulary, and ``loss_parallel`` computes it (replicated)."""
        return lm_loss_share(logits, targets, targets.numel())

    def _rows(self, tokens: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = tokens.shape[0] // self.topology.dp
        part = slice(self.dp_rank * rows, (self.dp_rank + 1) * rows)
        return tokens[part], targets[part]

    def _forward_backward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        tokens, targets = self._rows(tokens, targets)
        with loss_parallel():
            if self.schedule is None:
                loss = self.loss_fn(self.stage(tokens), targets)
                loss.backward()
                return _whole(loss.detach())
            losses: list[torch.Tensor] = []
            args = (tokens,) if self.first else ()
            kwargs = {"target": targets, "losses": losses} if self.last else {}
            self.schedule.step(*args, **kwargs)
        return torch.stack([_whole(x.detach()) for x in losses]).mean() if losses else None

    def clip(self) -> torch.Tensor:
        """torchtitan's ``clip_grad_norm_``: the DTensor norm, its square summed over pp."""
        params = [p for p in self.stage.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], 2.0)
        if isinstance(total, DTensor):
            total = total.full_tensor()
        if self.pp_group is not None:
            total = total**2
            dist.all_reduce(total, group=self.pp_group)
            total = total**0.5
        torch.nn.utils.clip_grads_with_norm_(params, MAX_NORM, total)
        return total

    def step(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor | None:
        loss = self._forward_backward(tokens, targets)
        self.clip()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss if self.counts else None

    def backward_only(self, tokens: torch.Tensor, targets: torch.Tensor) -> None:
        self._forward_backward(tokens, targets)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _global_loss(loss: torch.Tensor | None, dp: int) -> float:
    """The step's mean loss over the global batch: the counted shares summed, over dp."""
    total = torch.zeros(1, dtype=torch.float64)
    if loss is not None:
        total += float(loss)
    dist.all_reduce(total)
    return float(total) / dp


def _memory(runner: Any, batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, int]:
    """Resident parameters, gradients (after a backward) and AdamW state, and the peak of one
    more step: parameters and state plus the largest rise of live CPU bytes during it
    (torch's profiler; activations, gathered units and gradients), as torch_fsdp.py."""
    from torch.profiler import ProfilerActivity, profile

    params = [p for m in runner.modules for p in m.parameters()]
    runner.backward_only(*batch)
    grads = _storage_nbytes([p.grad for p in params if p.grad is not None])
    runner.opt.zero_grad(set_to_none=True)
    state = _storage_nbytes(
        [v for s in runner.opt.state.values() for k, v in s.items() if k != "step" and v.dim()]
    )
    held = _storage_nbytes(params)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(*batch)
    return {
        "params": held,
        "grads": grads,
        "state": state,
        "peak": held + state + peak_live_bytes(prof),
    }


def _full_state(runner: Any) -> dict[str, torch.Tensor]:
    """Every parameter this rank's modules name, whole along the dp (and, for torch's DTensor
    tensor parallelism, the tp) mesh dims: a collective over each parameter's mesh."""
    out = {}
    for module in runner.modules:
        for name, p in module.named_parameters():
            out[name] = p.full_tensor() if isinstance(p, DTensor) else p.detach()
    return out


def _param_difference(ours: _Gradsync, theirs: _Torch) -> float:
    """The largest difference between gradsync's pieces and torch's weights sliced to them."""
    full = _full_state(theirs)
    mine = _full_state(ours)
    worst = 0.0
    for part in ours.par.parts:
        want = local_state(part, full)
        for name in dict(part.named_parameters()):
            worst = max(worst, float((mine[name].detach() - want[name].detach()).abs().max()))
    return worst


def run_config(
    name: str, sizes: dict[str, int], args: argparse.Namespace, rank: int
) -> dict[str, Any]:
    """Build both compositions of one configuration, time them alternating, compare the
    losses and weights, measure the memory."""
    world = dist.get_world_size()
    config = LlamaConfig(**args.config)
    topology = topology_of(sizes, world)
    options = ParallelOptions(microbatches=args.microbatches, schedule=args.schedule)
    runners: dict[str, Any] = {
        GRADSYNC: _Gradsync(config, topology, options, args.seq),
        TORCH: _Torch(config, topology, options, args.seq),
    }
    gen = torch.Generator().manual_seed(7)
    data = []
    for _ in range(args.warmup + args.steps):
        rows = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
        data.append((rows[:, :-1], rows[:, 1:]))
    times: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    for r, batch in enumerate(data):
        order = list(runners) if r % 2 == 0 else list(runners)[::-1]
        for key in order:
            dist.barrier()
            start = time.perf_counter()
            loss = runners[key].step(*batch)
            elapsed = _slowest(time.perf_counter() - start)
            losses[key].append(_global_loss(loss, topology.dp))
            if r >= args.warmup:
                times[key].append(elapsed)
    difference = _param_difference(runners[GRADSYNC], runners[TORCH])
    worst = torch.tensor([difference], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    memory = {key: _memory(runner, data[0]) for key, runner in runners.items()}
    rows: list[Any] = [None] * world
    mine = {"memory": memory, "pp_rank": topology.coordinates(rank).get("pp", 0)}
    dist.all_gather_object(rows, mine)
    step = {k: statistics.median(t) for k, t in times.items()}
    pairs = zip(losses[GRADSYNC], losses[TORCH], strict=True)
    return {
        "sizes": sizes,
        "step_s": step,
        "ratio": step[GRADSYNC] / step[TORCH],
        "losses": losses,
        "loss_difference": max(abs(a - b) / abs(b) for a, b in pairs),
        "param_difference": float(worst),
        "memory": {k: [row["memory"][k] for row in rows] for k in runners},
        "pp_rank": [row["pp_rank"] for row in rows],
    }


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    # DTensor's note that gathering a parameter sharded over dp and tp on one dim takes two
    # all-gathers (the weight comparison's full_tensor), once per rank and parameter.
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        results = {name: run_config(name, sizes, args, rank) for name, sizes in args.configs}
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()
