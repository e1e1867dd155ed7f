"""The torch side of ``cost_model.py``: profile the model, run each configuration, measure it.

Every configuration is built from the plans ``gradsync_core.plan.predict`` made for it (the
pipeline plan itself, and a check that ``DataParallel``'s buckets are the predicted ones), so
what is measured is what was costed. Each runs in the same process tree, one round of every
configuration after another (the order rotating), and its time is the median over the timed
rounds of the slowest rank's step: ``zero_grad``, forward, loss, backward, the optimizer step.
Its peak is the most live CPU bytes (torch's profiler) during one step, counted from every
allocation the configuration made since it was built.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import ProfilerActivity, profile, record_function

from gradsync_core.plan import (
    Configuration,
    MachineProfile,
    ModelProfile,
    median_profile,
    predict,
)
from gradsync_torch import (
    DataParallel,
    Pipeline,
    ProcessGroups,
    ZeroRedundancyOptimizer,
    fully_shard,
    hsdp_mesh,
    param_specs,
    split_model,
)
from gradsync_torch.cost import machine as calibrate
from gradsync_torch.cost.host import Probe
from gradsync_torch.cost.model import profile_model

LR = 1e-3
STEP = "measured step"


class Block(nn.Module):
    """One layer: ``gelu(fc(x))``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.gelu(self.fc(x))


class Net(nn.Module):
    """``layers`` blocks in a row: a ZeRO-3 unit and a pipeline layer each."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(Block(width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def build_net(args: argparse.Namespace) -> Net:
    torch.manual_seed(0)
    return Net(args.layers, args.width)


def square_loss(out: torch.Tensor, target: Any = None) -> torch.Tensor:
    return out.square().mean()


def batch(args: argparse.Namespace, rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, args.width, generator=torch.Generator().manual_seed(seed))


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=LR, foreach=True)


class Profiler:
    """The model profile at every microbatch size the configurations run, measured on every
    rank at once (as ranks compute at once in a step): once before the configurations are
    built, then one step per round between them, so the profile sees the machine's load as
    the measured steps do. Each round's slowest rank counts (the largest forward, backward
    and optimizer step in all), on every rank: a step is timed by its slowest rank, and where
    the ranks outnumber the cores they do not all get the same share of them."""

    def __init__(self, args: argparse.Namespace, configs: list[Configuration], world: int) -> None:
        sizes = sorted({microbatch_size(args, world, c) for c in configs})
        self.nets = {n: build_net(args) for n in sizes}
        self.opts = {n: adam(net.parameters()) for n, net in self.nets.items()}
        self.inputs = {n: batch(args, n, 0) for n in sizes}
        first = {n: self.profile(n, args.profile_steps, warmup=2) for n in sizes}
        self.scratch = {n: p.optimizer_bytes for n, p in first.items()}
        self.rounds: dict[int, list[ModelProfile]] = {n: [] for n in sizes}
        self.first = self._slowest(first)

    def profile(self, n: int, steps: int, warmup: int = 0) -> ModelProfile:
        net, x = self.nets[n], self.inputs[n]
        return profile_model(
            net,
            lambda: square_loss(net(x)),
            samples=n,
            optimizer=self.opts[n],
            steps=steps,
            warmup=warmup,
            scratch=warmup > 0,
        )

    def round(self) -> None:
        profiles = self._slowest({n: self.profile(n, 1) for n in self.rounds})
        for n, slowest in profiles.items():
            self.rounds[n].append(slowest)

    def plain_step(self, n: int) -> float:
        """One plain step (no communication) of the profiled model: the compute alone."""
        net, x, opt = self.nets[n], self.inputs[n], self.opts[n]
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        square_loss(net(x)).backward()
        opt.step()
        return time.perf_counter() - start

    @staticmethod
    def _slowest(profiles: dict[int, ModelProfile]) -> dict[int, ModelProfile]:
        """Per microbatch size, the profile of the rank whose step computed longest."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, {n: p.to_json() for n, p in profiles.items()})
        out = {}
        for n in profiles:
            found = [ModelProfile.from_json(ranks[n]) for ranks in everyone]
            out[n] = max(found, key=lambda p: p.forward_s + p.backward_s + p.optimizer_s)
        return out

    def final(self) -> dict[int, ModelProfile]:
        return {
            n: replace(median_profile(runs), optimizer_bytes=self.scratch[n])
            for n, runs in self.rounds.items()
        }


class Calibrator:
    """``gradsync calibrate``'s measurements, one round between every round of steps, so the
    machine profile sees the load the steps see; the fit is over each point's median."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.points: dict[tuple[str, int, int], list[float]] = {}
        self.issued: dict[tuple[str, int, int], list[float]] = {}
        self.copies: list[float] = []
        self.slowdowns: list[dict[str, float]] = []
        self.probe = Probe(torch.device("cpu"))  # the executors' host overheads (host.py)
        self.scratch = calibrate.collective_scratch()  # the same each time: measured once

    def round(self) -> None:
        self.probe.round()
        done, issued = calibrate.measure(repeats=1)
        for into, measured in ((self.points, done), (self.issued, issued)):
            for (collective, size), samples in measured.items():
                for nbytes, seconds in samples:
                    into.setdefault((collective, size, nbytes), []).append(seconds)
        self.copies.append(calibrate.copy_bandwidth(repeats=1))
        self.slowdowns.append(calibrate.overlap_slowdowns(repeats=3))

    @staticmethod
    def _samples(
        points: dict[tuple[str, int, int], list[float]],
    ) -> dict[tuple[str, int], list[tuple[int, float]]]:
        out: dict[tuple[str, int], list[tuple[int, float]]] = {}
        for (collective, size, nbytes), times in sorted(points.items()):
            out.setdefault((collective, size), []).append((nbytes, statistics.median(times)))
        return out

    def profile(self) -> MachineProfile:
        return calibrate.profile_from(
            self._samples(self.points),
            self._samples(self.issued),
            ranks_per_node=self.world,
            name="cost_model.py, between the steps",
            source=f"gradsync_torch.cost.machine.measure, {len(self.copies)} rounds",
            copy=statistics.median(self.copies),
            slowdowns={  # each round's figure is already a mean of shares: the same over rounds
                kind: calibrate.mean_slowdown([1 / s[kind] for s in self.slowdowns])
                for kind in self.slowdowns[0]
            },
            probe=self.probe.times(),
            world_size=self.world,
            scratch=self.scratch,
            cores=calibrate.compute_cores(),
        )


class Runner:
    """One configuration, built on this rank: ``step()`` runs one training step."""

    def __init__(self, args: argparse.Namespace, prediction: Any, rank: int) -> None:
        c: Configuration = prediction.configuration
        topology = prediction.topology
        self.samples = prediction.samples
        self.x = batch(args, prediction.samples * c.microbatches, 1 + rank)
        self.match = True
        net = build_net(args)
        if c.pp > 1:
            groups = ProcessGroups(topology)
            plan = prediction.pipeline
            split = split_model(net.layers, plan, groups.group_rank("pp"))
            stages: dict[int, nn.Module] = dict(split.stages)
            if topology.dp > 1:
                dp = groups["dp"].process_group
                stages = {
                    s: DataParallel(m, process_group=dp, overlap=False) for s, m in stages.items()
                }
            self.pipe = Pipeline(plan, stages, groups=groups, loss_fn=square_loss)
            self.opt = adam(self.pipe.parameters())
            self.first = 0 in stages
            self.run = self._pipeline
            return
        if c.zero == 3:
            mesh = hsdp_mesh(topology)
            for layer in net.layers:
                fully_shard(layer, mesh=mesh, reshard_after_forward=c.reshard_after_forward)
            fully_shard(net, mesh=mesh, reshard_after_forward=c.reshard_after_forward)
            self.model: nn.Module = net
            self.opt = adam(net.parameters())
            self.match = net_plan_matches(net, prediction)
        else:
            wrapper = DataParallel(
                net,
                bucket_cap_mb=c.bucket_cap_mb,
                overlap=c.overlap,
                shard_gradients=c.zero == 2,
            )
            # compared after the steps: DataParallel rebuilds its buckets after the first
            self.buckets = prediction.buckets.fingerprint
            self.model = wrapper
            if c.zero:
                self.opt = ZeroRedundancyOptimizer(
                    net.named_parameters(),
                    torch.optim.Adam,
                    lr=LR,
                    shard_gradients=c.zero == 2,
                    data_parallel=wrapper if c.zero == 2 else None,
                    bucket_cap_mb=c.bucket_cap_mb or 25.0,
                )
                self.match = self.opt.plan().fingerprint == prediction.shards.fingerprint
            else:
                self.opt = adam(net.parameters())
        self.overlap = c.overlap
        self.run = self._data_parallel

    def _data_parallel(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        square_loss(self.model(self.x)).backward()
        if not self.overlap:
            self.model.sync_gradients()
        self.opt.step()

    def _pipeline(self) -> None:
        self.opt.zero_grad(set_to_none=True)
        self.pipe.step(*((self.x,) if self.first else ()), target=self.x)
        self.opt.step()

    def step(self) -> None:
        self.run()

    def plan_matches(self) -> bool:
        """Whether the plans in force now are the predicted ones."""
        buckets = getattr(self, "buckets", None)
        if buckets is None:
            return self.match
        return self.match and self.model.bucket_plan.fingerprint == buckets


def net_plan_matches(net: nn.Module, prediction: Any) -> bool:
    """Whether fully_shard's plan is the predicted one (the root unit's plan covers all)."""
    plan = net.shard_plan  # type: ignore[attr-defined]
    plan = plan() if callable(plan) else plan
    return bool(plan.fingerprint == prediction.param_shards.fingerprint)


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _peak_live(prof: Any) -> int:
    """Live CPU bytes at the measured step's start (all this configuration allocated since
    it was built) plus their largest rise during the step, the live set kept by address
    (``calibrate.live_peak``: a buffer gloo's thread frees is otherwise never freed)."""
    marks = [e for e in prof.profiler.kineto_results.events() if e.name() == STEP]
    start, end = marks[-1].start_ns(), marks[-1].end_ns()
    allocations = [a for a in calibrate.cpu_allocations(prof) if a[0] <= end]
    return calibrate.live_peak(allocations, start)


def microbatch_size(args: argparse.Namespace, world: int, config: Configuration) -> int:
    """A rank's microbatch under ``config``: the model profile it reads."""
    return int(args.global_batch // (world // config.pp * config.microbatches))


def worker(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        machine = MachineProfile.from_json(args.machine)
        specs = param_specs(build_net(args))
        configs = [Configuration(**entry) for entry in args.configurations]
        profiler = Profiler(args, configs, world)
        calibrator = Calibrator(world)

        def predictions(profiles: dict[int, ModelProfile], machine: MachineProfile) -> list[Any]:
            return [
                predict(
                    specs,
                    config,
                    world_size=world,
                    machine=machine,
                    model=profiles[microbatch_size(args, world, config)],
                    global_batch=args.global_batch,
                )
                for config in configs
            ]

        runners, peaks = [], []
        for prediction in predictions(profiler.first, machine):
            gc.collect()
            dist.barrier()
            with profile(
                activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
            ) as prof:  # the operators' inputs: a collective's copy is freed with its input
                runner = Runner(args, prediction, rank)
                for _ in range(args.warmup):
                    runner.step()
                dist.barrier()
                with record_function(STEP):
                    runner.step()
            peak = torch.tensor([_peak_live(prof)], dtype=torch.float64)
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            runners.append(runner)
            peaks.append(int(peak.item()))
        times: list[list[float]] = [[] for _ in runners]
        plain: list[float] = []
        for r in range(args.steps):
            order = list(range(len(runners)))
            order = order[r % len(order) :] + order[: r % len(order)]
            dist.barrier()
            calibrator.round()
            dist.barrier()
            profiler.round()
            dist.barrier()
            plain.append(_slowest(profiler.plain_step(max(profiler.nets))))
            for i in order:
                dist.barrier()
                start = time.perf_counter()
                runners[i].step()
                times[i].append(_slowest(time.perf_counter() - start))
        calibrated = calibrator.profile()
        profiles = profiler.final()
        read = {c.describe(): profiles[microbatch_size(args, world, c)] for c in configs}
        final = predictions(profiles, calibrated)
        standalone = predictions(profiles, machine)
        if rank == 0:
            out.put(
                [
                    {
                        "label": p.configuration.describe(),
                        "configuration": p.configuration.to_json(),
                        "predicted_step_s": p.step_s,
                        "standalone_step_s": alone.step_s,
                        "predicted_compute_s": p.cost.compute_s,
                        "compute_only_s": statistics.median(plain),
                        "predicted_exposed_s": p.cost.exposed_comm_s,
                        "predicted_peak_bytes": p.peak_bytes,
                        "step_s": statistics.median(t),
                        "peak_bytes": peak,
                        "plan_match": runner.plan_matches(),
                        "host_s": dict(calibrated.host_s),
                        "step_host_s": dict(calibrated.step_host_s),
                        "overlap_slowdowns": dict(calibrated.overlap_slowdowns),
                        "inputs": {  # what the prediction read (cost_model.py --save)
                            "machine": calibrated.to_json(),
                            "model": read[p.configuration.describe()].to_json(),
                        },
                    }
                    for p, alone, t, peak, runner in zip(
                        final, standalone, times, peaks, runners, strict=True
                    )
                ]
            )
        dist.barrier()
        del runners
    finally:
        dist.destroy_process_group()
