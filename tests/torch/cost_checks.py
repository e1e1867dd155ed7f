"""Rank bodies of tests/torch/test_cost.py: calibrate, profile, predict and measure on gloo."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core.plan import Configuration, predict
from gradsync_torch import DataParallel, param_specs
from gradsync_torch.cost import machine as calibrate
from gradsync_torch.cost.host import Probe, message_posts
from gradsync_torch.cost.model import profile_model

LAYERS, WIDTH, ROWS = 32, 64, 8
# Two configurations far apart: one bucket for the whole model, and one per tensor (64 of
# them, each paying a collective's latency and issue), on a model whose compute is small.
CONFIGURATIONS = (Configuration(bucket_cap_mb=25.0), Configuration(bucket_cap_mb=0.001))


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)))


def calibrate_predict_measure(
    rank: int, world_size: int
) -> tuple[list[tuple[float, float, bool]], dict[str, dict[str, float]]]:
    """``(predicted, measured, plan is the predicted)`` step seconds of each configuration,
    and the calibrated host overheads and collective scratch."""
    # Sizes far apart, so a loaded machine still shows time growing with the size.
    samples, issue = calibrate.measure(sizes=(4096, 1 << 20, 8 << 20), repeats=5)
    probe = Probe(torch.device("cpu"))
    for _ in range(calibrate.PROBE_ROUNDS):
        probe.round()
    machine = calibrate.profile_from(
        samples,
        issue,
        ranks_per_node=world_size,
        name="test",
        source="tests/torch/cost_checks.py",
        copy=calibrate.copy_bandwidth(repeats=3),
        probe=probe.times(),
        world_size=world_size,
        scratch=calibrate.collective_scratch(),
        slowdowns=calibrate.overlap_slowdowns(),
        posts=message_posts(torch.device("cpu")),
    )
    net, x = _net(), torch.randn(ROWS, WIDTH)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    model = profile_model(net, lambda: net(x).square().mean(), samples=ROWS, optimizer=opt)
    shared = [model.to_json()]
    dist.broadcast_object_list(shared, src=0)  # every rank predicts with rank 0's profile
    model = type(model).from_json(shared[0])
    out = []
    for config in CONFIGURATIONS:
        prediction = predict(
            param_specs(_net()),
            config,
            world_size=world_size,
            machine=machine,
            model=model,
            optimizer="sgd",
        )
        net = _net()
        wrapper = DataParallel(net, bucket_cap_mb=config.bucket_cap_mb)
        opt = torch.optim.SGD(net.parameters(), lr=0.01)
        times = []
        for step in range(12):
            dist.barrier()
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            wrapper(x).square().mean().backward()
            opt.step()
            elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if step >= 3:
                times.append(elapsed.item())
        same = wrapper.bucket_plan.fingerprint == prediction.buckets.fingerprint
        out.append((prediction.step_s, statistics.median(times), same))
    return out, {
        "host_s": dict(machine.host_s),
        "step_host_s": dict(machine.step_host_s),
        "collective_scratch": dict(machine.collective_scratch),
        "overlap_slowdowns": dict(machine.overlap_slowdowns),
        "overlap_slowdown": {"": machine.overlap_slowdown},
        "post_s": dict(machine.post_s),
        # the pairs measured whatever the node, and whether this one's cores are full
        "pair_slowdowns": calibrate.overlap_slowdowns(measure=True),
        "oversubscribed": {"": float(calibrate.oversubscribed())},
        "threads": {"": float(torch.get_num_threads())},
        "cores": {"": float(calibrate.compute_cores() or 0)},
        # rank r's figure r + 1: groups of one average 1 and 2; one group of both takes 2
        "group_slowest": {
            str(size): calibrate._group_slowest(float(rank + 1), size) for size in (1, 2)
        },
    }


def broadcast_frees(rank: int, world_size: int) -> list[int]:
    """Bytes of each ``broadcast_tensors`` packing buffer whose free the profiler recorded,
    over 20 broadcasts of a 1 MiB tensor (the free must happen on this thread)."""
    from torch.profiler import ProfilerActivity, profile

    from gradsync_torch._collectives import broadcast_tensors

    tensor = torch.ones(1 << 18)
    frees = []
    for _ in range(20):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            broadcast_tensors([tensor], dist.group.WORLD)
        frees += [-n for _, _, n in calibrate.cpu_allocations(prof) if n == -tensor.nbytes]
    return frees
