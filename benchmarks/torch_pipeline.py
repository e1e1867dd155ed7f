"""Pipeline step time, memory and bubble: gradsync's executor vs torch.distributed.pipelining.

docs/design.md §11: both run in the same process tree on 4 gloo ranks, alternating step by
step, on copies of the same stage modules (``split_model`` of one GPT, examples/
pipeline_models.py) with the same schedule and data; each time is the median over the timed
rounds of the slowest rank's step (the pipeline step, SGD's step, zero_grad). Layouts:

    pp 4           4 pipeline ranks (1 stage each for GPipe and 1F1B, 2 for the others)
    pp 2 x dp 2    2 pipelines of 2; gradsync's stages in DataParallel(overlap=False),
                   reduced at the plan's REDUCE_GRAD; torch's reduced after the step by one
                   all-reduce of the flattened gradients

Schedules: GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble (ZB1P). For each layout and
schedule it reports the step-time ratio (gradsync / torch), the peak of live CPU bytes during
one step per rank (torch's profiler), gradsync's peak stash (microbatch activations held at
once) beside the plan's, whether the two ended with bitwise equal weights, and the **bubble**:
each rank's idle time in gradsync's steps (the pipeline's step, its slowest rank's, minus
the rank's computes, each measured from the moment its input is there: the definition of
``simulate_pipeline``'s ``idle``) beside the simulator's prediction. The simulation is fed
the stage times measured in the same run (each stage's mean forward, backward, input and
weight gradient time: the simulated ranks compute as long as the measured ones) and five
costs measured apart from the pipelined steps, right after them (never fitted to them),
each with every rank busy, as in a step (4 ranks share the machine's cores):

    overhead   the executor's host time per compute: a one-stage pipeline (pp 1) of a tiny
               stage on every rank, its step less its computes, per compute
    send_post  the host time of posting one send of an activation (isend returning) from
               pipeline rank 0 to 1 as a step posts it: rank 0 sends after each 4 ms of
               computing, rank 1 posted its receives first and computes, the others compute
    receive_post  the host time of posting one receive there (its buffer allocated; irecv
               returning), the executor posting every receive of a step at its start
    p2p        an activation's trip: ranks 0 and 1 exchanging activations back and forth
               while the other ranks compute, half the round trip less one post of that
               exchange (post_s; the JSON also has both with the other ranks waiting,
               *_unloaded_s)
    reduce     each stage's REDUCE_GRAD alone, as the executor runs it (DataParallel's
               sync_gradients at dp 2, then the 1/microbatches scale), after one more step:
               its wall time (reduce_s, the slower copy's) and its process's CPU time
               (reduce_cpu_s, each copy's: all threads, gloo's that run the all-reduce)

In the message exchanges every receive is posted before its send, as in gradsync's steps on gloo
(the executor posts every receive of a step at its start). A receive posted after its send
costs more (late_receive_post_s, shown in brackets beside post: a receive posted 2 ms after
its send; and its data then waits for a round trip between the two ranks): the simulator
charges every post the same, which holds because no step's receive comes late.

A send inside a step takes longer than either post (1-6 ms against 0.1-0.5 ms, the third
and fourth sittings): its thread is runnable but off its core (a probe of 2 steps counted
1-3 involuntary context switches and 0.1-0.3 ms of CPU time in such an isend, no voluntary
one: it waits for nothing), since the data it writes wakes the receiver's gloo thread, and
the receiver itself when it waits for the data, on a machine where the 4 ranks share 2
cores. A send to a receiver that waits for it is measured apart too (waking_send_post_s, in
brackets beside send_post); it does not reach the in-step cost either, so the simulation
does not take it.

Beside them, each rank's host time in the steps (its posts and reductions, from the
executor's timeline) and the simulation's (its posts, reductions and overheads): a check of
the costs, never fed back into the simulation. At dp 2 a step's REDUCE_GRAD also waits for
its data-parallel peer in the other pipeline, which the simulation of the two pipelines
together models (below).

The 4 ranks share the machine's cores, and a pipeline keeps several of them computing at
once (interleaved and zero-bubble schedules most), so the figure compared is the simulation
with the ranks sharing the machine's cores (``simulate_pipeline``'s ``cores``:
``len(os.sched_getaffinity(0))``). At dp 2 the two pipelines are simulated together
(``simulate_pipeline``'s ``dp``): all 4 ranks on the machine's cores, each stage's
REDUCE_GRAD a rendezvous of its two copies, and every input a CPU time, so that the
simulated ranks do the CPU work the measured ones did: each replica's own computes' CPU
times (its ranks'), each copy's reduction's CPU time (reduce_cpu_s), the posts' as below,
and as overhead per compute each rank's CPU time in the step less its computes, posts and
reductions' CPU time (host_cpu_per_compute_dp_s); each rank's idle is then its own
pipeline's step (its replica's last end) less its computes, as measured. Beside it, the
simulation of before (one pipeline on the cores over dp, its reduction fed the wall time;
"one pipeline"). At dp 1 the one pipeline on the machine's cores is fed
what each action takes on a core of its own: each compute's and each post's
CPU time (its thread's ``time.thread_time``, in the same steps and the same post
measurement), as the overhead per compute each rank's CPU time in the step
(``time.process_time``: all its threads) outside its computes, posts and reductions, over
its computes, the mean of the ranks (``host_cpu_per_compute_s``: the executor's host work
and gloo's threads, which write and read each message; the probe's overhead is a part of
it), the trip with the other ranks waiting (``p2p_unloaded_s``) and the same reduce. The
simulation with a core per rank, fed the wall times as before, is printed beside it ("a
core per rank").

At dp 2 each pipeline's ranks (every thread of theirs, gloo's too) are pinned to cores / dp
of the machine's of their own (``--no-pin``: not), and the two pipelines are simulated so
(``pinned=True``): unpinned, the kernel placed the 4 ranks on the 2 cores unevenly for tens
of milliseconds, one pipeline drifted ahead of the other and its reductions waited for their
peers, a wait that varied run to run (docs/benchmarks.md, seventh sitting). ``--timeline``
prints each rank's computes and reductions in the last timed step, measured (one clock for
every rank) and simulated.

torch's pipelining with DDP stages fails here at dp 2 (torch 2.13, GPipe: "rebuilt parameter
indices size is not same as original model parameters size" in DDP's reducer, and its split
weight gradients bypass DDP's hooks), so torch's side reduces the gradients itself.

    python benchmarks/torch_pipeline.py --repeat 3        # GPT 8 x 256, 8 microbatches
    python benchmarks/torch_pipeline.py --quick
    python benchmarks/torch_pipeline.py --schedules Interleaved1F1B --layouts "pp 4"
    python benchmarks/torch_pipeline.py --layouts "pp 2 x dp 2" --timeline

The last line is one JSON object: {"bench": "torch_pipeline", "ratio_vs_anchor": the median
of the step-time ratios over every layout and schedule, "<layout>/<schedule>": {...}, ...};
the anchor is torch's pipelining.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks
from zero3_memory import peak_live_bytes

from examples.pipeline_models import gpt_blocks, lm_loss, token_batch
from gradsync_core import Topology, plan_pipeline, simulate_pipeline
from gradsync_torch import DataParallel, Pipeline, ProcessGroups, split_model

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble")
LAYOUTS = {"pp 4": 4, "pp 2 x dp 2": 2}  # name: pp, at 4 ranks
TORCH = {
    "GPipe": torch_schedules.ScheduleGPipe,
    "1F1B": torch_schedules.Schedule1F1B,
    "Interleaved1F1B": torch_schedules.ScheduleInterleaved1F1B,
    "InterleavedZeroBubble": torch_schedules.ScheduleInterleavedZeroBubble,
}
SINGLE = ("GPipe", "1F1B")
MIB = 1024 * 1024
LR = 1e-3


class _Torch:
    """torch's schedule over copies of the stages; with dp > 1, one all-reduce (mean) of the
    flattened gradients after the step (torch's pipelining leaves data parallelism to the
    user, and its DDP path fails here: see the module docstring)."""

    def __init__(self, name: str, plan: Any, stages: dict[int, nn.Module], groups: Any) -> None:
        dp = groups["dp"]
        self.dp = dp.process_group if dp.size > 1 else None
        self.dp_size = dp.size
        self.stages = stages
        built = [
            PipelineStage(
                m, s, plan.num_stages, torch.device("cpu"), group=groups["pp"].process_group
            )
            for s, m in sorted(stages.items())
        ]
        cls = TORCH[name]
        self.schedule = cls(
            built[0] if name in SINGLE else built, plan.microbatches, loss_fn=lm_loss
        )
        self.opt = torch.optim.SGD([p for m in stages.values() for p in m.parameters()], lr=LR)
        self.first, self.last = 0 in stages, plan.num_stages - 1 in stages

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        args = (x,) if self.first else ()
        kwargs = {"target": y} if self.last else {}
        self.schedule.step(*args, **kwargs)
        if self.dp is not None:
            grads = [p.grad for m in self.stages.values() for p in m.parameters()]
            flat = _flatten_dense_tensors(grads).div_(self.dp_size)
            dist.all_reduce(flat, group=self.dp)
            for grad, reduced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
                grad.copy_(reduced)
        self.opt.step()
        self.opt.zero_grad()

    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for m in self.stages.values():
            out.update({n: p.detach() for n, p in m.named_parameters()})
        return out


class _Ours:
    """gradsync's Pipeline over the same stages (in DataParallel when dp > 1)."""

    def __init__(self, plan: Any, stages: dict[int, nn.Module], groups: Any) -> None:
        dp = groups["dp"]
        if dp.size > 1:
            stages = {
                s: DataParallel(m, process_group=dp.process_group, overlap=False)
                for s, m in stages.items()
            }
        self.pipe = Pipeline(plan, stages, groups=groups, loss_fn=lm_loss)
        self.opt = torch.optim.SGD(self.pipe.parameters(), lr=LR)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.pipe.step(x, target=y)
        self.opt.step()
        self.opt.zero_grad()

    def weights(self) -> dict[str, torch.Tensor]:
        out = {}
        for m in self.pipe.stages.values():
            inner = m.module if isinstance(m, DataParallel) else m
            out.update({n: p.detach() for n, p in inner.named_parameters()})
        return out


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _peak_bytes(runner: Any, x: torch.Tensor, y: torch.Tensor) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        runner.step(x, y)
    return peak_live_bytes(prof)


def _stage_times(records: list[list[Any]]) -> dict[tuple[int, str], float]:
    """Each (stage, kind)'s mean compute time over the recorded steps (the mean, so that the
    simulated ranks compute as long as the measured ones, and their idle times compare)."""
    times: dict[tuple[int, str], list[float]] = {}
    for timeline in records:
        for timed in timeline:
            if not timed.action.is_compute:
                continue
            key = (timed.action.stage, timed.action.kind)
            times.setdefault(key, []).append(timed.end - timed.start)
    return {key: statistics.mean(v) for key, v in times.items()}


class _CpuTimes:
    """Each compute's CPU time in a pipeline's recorded steps (``Pipeline.timeline`` set): its
    thread's (``time.thread_time``; torch runs a CPU compute, its backward too, on the calling
    thread at one intra-op thread), from the moment its input is there, as the timeline
    measures it. That is the compute's time on a core of its own: the sharing of the cores,
    which stretches its wall time, does not stretch it. Recorded by wrapping the pipeline
    object's ``_begin`` and ``_note`` (the executor itself is unchanged)."""

    def __init__(self, pipe: Pipeline) -> None:
        self.times: dict[tuple[int, str], list[float]] = {}
        self._mark: float | None = None
        begin, note = pipe._begin, pipe._note

        def _begin() -> None:
            begin()
            self._mark = time.thread_time()

        def _note(action: Any, start: float) -> None:
            if action.is_compute and self._mark is not None and pipe.timeline is not None:
                took = time.thread_time() - self._mark
                self.times.setdefault((action.stage, action.kind), []).append(took)
            self._mark = None
            note(action, start)

        pipe._begin = _begin  # type: ignore[method-assign]
        pipe._note = _note  # type: ignore[method-assign]

    def means(self) -> dict[tuple[int, str], float]:
        return {key: statistics.mean(v) for key, v in self.times.items()}

    def total(self) -> float:
        return sum(sum(v) for v in self.times.values())


class _Probe:
    """A one-stage pipeline (pp 1) of a tiny stage on every rank: what gradsync's executor
    costs per compute apart from the compute (dispatch, bookkeeping)."""

    def __init__(self, microbatches: int) -> None:
        topology = Topology.create(dist.get_world_size(), pp=1)
        plan = plan_pipeline(
            schedule="GPipe", microbatches=microbatches, topology=topology, layers=1
        )
        torch.manual_seed(0)
        self.pipe = Pipeline(
            plan,
            {0: nn.Linear(1, 1)},
            groups=ProcessGroups(topology),
            loss_fn=lambda out, target: (out - target).square().sum(),
        )
        self.x = torch.ones(microbatches, 1)
        self.computes = sum(a.is_compute for a in plan.actions[0])
        self.cpu = _CpuTimes(self.pipe)

    def overhead(self, rounds: int = 8) -> tuple[float, float]:
        """The median over ``rounds`` steps (after one more) of (step - computes) per
        compute, the slowest rank's: ``(wall, cpu)``, the second in the thread's CPU time
        (what it takes on a core of its own: the 4 ranks run this at once on the machine's
        cores)."""
        per_compute, per_compute_cpu = [], []
        for _ in range(rounds + 1):
            self.pipe.timeline = []
            self.cpu.times.clear()
            cpu = time.thread_time()
            self.pipe.step(self.x, target=self.x)
            cpu = time.thread_time() - cpu
            busy = sum(t.end - t.start for t in self.pipe.timeline if t.action.is_compute)
            per_compute.append((self.pipe.step_seconds - busy) / self.computes)
            per_compute_cpu.append((cpu - self.cpu.total()) / self.computes)
            for p in self.pipe.parameters():
                p.grad = None
        self.pipe.timeline = None
        return (
            _slowest(statistics.median(per_compute[1:])),
            _slowest(statistics.median(per_compute_cpu[1:])),
        )


def _reduce_seconds(pipe: Pipeline, rounds: int = 5) -> dict[int, tuple[float, float]]:
    """Each of this rank's stages' ``REDUCE_GRAD`` alone, as the executor runs it (the
    data-parallel ``sync_gradients()`` of a ``DataParallel`` stage, then the 1/microbatches
    scale), on the gradients of the step just run: the median over ``rounds`` of its wall
    time and of its process's CPU time (``time.process_time``: all threads, gloo's that run
    the all-reduce too; its time on a core of its own)."""
    times: dict[int, list[tuple[float, float]]] = {s: [] for s in pipe.stages}
    m = pipe.plan.microbatches
    for _ in range(rounds):
        dist.barrier()
        for s, module in sorted(pipe.stages.items()):
            start, cpu = time.perf_counter(), time.process_time()
            if isinstance(module, DataParallel):
                module.sync_gradients()
            with torch.no_grad():
                for p in module.parameters():
                    if p.grad is not None:
                        p.grad.div_(m)
            times[s].append((time.perf_counter() - start, time.process_time() - cpu))
    return {
        s: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
        for s, t in times.items()
    }


def _reduce_cpu_in_step(pipe: Pipeline) -> list[float]:
    """Each ``REDUCE_GRAD``'s CPU time in the steps (``time.process_time``: all threads), in
    the order they ran, appended to the list returned (by wrapping the pipeline object's
    ``_reduce``; the executor itself is unchanged)."""
    taken: list[float] = []
    reduce = pipe._reduce

    def _reduce(stage: Any) -> None:
        cpu = time.process_time()
        reduce(stage)
        taken.append(time.process_time() - cpu)

    pipe._reduce = _reduce  # type: ignore[method-assign]
    return taken


def _pin(cores: list[int]) -> None:
    """Every thread of this process (gloo's too) on these cores."""
    for task in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(task), cores)


def _busy(seconds: float, *, size: int = 128) -> None:
    """Compute on this rank's core for ``seconds`` (single-threaded products of ``size`` x
    ``size`` matrices)."""
    a = torch.randn(size, size)
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        torch.mm(a, a)


def _message_costs(
    groups: Any, shape: tuple[int, ...], *, loaded: bool, seconds: float = 0.2, late: int = 8
) -> tuple[float, float, float]:
    """An activation's messages between pipeline ranks 0 and 1 of the first pipeline group,
    back and forth for ``seconds``: ``(post, trip, late post)``, the mean host time of
    posting one send or receive (its buffer allocated, as the executor does:
    ``isend``/``irecv`` returning; a mean, as a step posts as many sends as receives and
    gloo writes a send's data at once when its receive is posted), half the mean round trip
    (a mean too, as the post is subtracted from it), and the median post of a receive whose
    send was posted 2 ms before it (``late`` of them), the slower rank's.
    With ``loaded`` every other rank computes meanwhile (single-threaded matrix products),
    as in a step, where a message's two ranks share the cores with the other ranks'
    computes; without, the other ranks wait."""
    pp = groups["pp"]
    pair = groups.topology.group_at("pp", 0)[:2]  # global ranks
    posts: list[float] = []
    trips: list[float] = []
    late_posts: list[float] = []
    dist.barrier()
    began = time.perf_counter()

    def post(op: Any, tensor: torch.Tensor, peer: int, into: list[float]) -> Any:
        start = time.perf_counter()
        if op is dist.irecv:
            tensor = torch.empty_like(tensor)
            work = dist.irecv(tensor, group=pp.process_group, group_src=peer)
        else:
            work = dist.isend(tensor, group=pp.process_group, group_dst=peer)
        into.append(time.perf_counter() - start)
        return work, tensor

    if dist.get_rank() in pair:
        first, peer = pp.group_rank == 0, 1 - pp.group_rank
        out = torch.zeros(shape)
        flag = out.view(-1)  # rank 0 says in the first element whether another trip follows
        more = True
        while more:
            start = time.perf_counter()
            if first:
                flag[0] = float(time.perf_counter() - began < seconds)
                receive, got = post(dist.irecv, out, peer, posts)
                send, _ = post(dist.isend, out, peer, posts)
                send.wait()
                receive.wait()
                more = bool(flag[0])
            else:
                receive, got = post(dist.irecv, out, peer, posts)
                receive.wait()
                more = bool(got.view(-1)[0])
                out = got
                send, _ = post(dist.isend, out, peer, posts)
                send.wait()
            trips.append(time.perf_counter() - start)
        for _ in range(late):  # rank 0 sends, rank 1 posts its receive 2 ms later
            if first:
                send, _ = post(dist.isend, out, peer, [])
                send.wait()
            else:
                time.sleep(0.002)
                receive, _ = post(dist.irecv, out, peer, late_posts)
                receive.wait()
    elif loaded:
        _busy(seconds * 1.25 + late * 0.003, size=256)
    one_post = statistics.mean(posts) if posts else 0.0
    trip = statistics.mean(trips) / 2 if trips else 0.0
    late_post = statistics.median(late_posts) if late_posts else 0.0
    return _slowest(one_post), _slowest(trip), _slowest(late_post)


def _step_posts(
    groups: Any, shape: tuple[int, ...], *, count: int = 16, rounds: int = 3, chunk: float = 0.004
) -> tuple[float, float, float, float, float]:
    """The host time of posting an activation's messages as a step posts them, the slower
    rank's mean: ``(send, receive, send to a waiting receiver, send's CPU time, receive's
    CPU time)``, the last two the posting thread's (a post's time on a core of its own).
    Every rank computes, as in a step, where more ranks compute than the machine has cores
    (4 ranks on 2 here).

    First pipeline rank 1 posts ``count`` receives (as the executor posts a step's receives
    at its start, each buffer allocated) and computes while they arrive; rank 0 sends one
    after each ``chunk`` of computing; the others compute. Then rank 1 waits for each
    message before computing half a chunk, as a stage waits for its input: each send wakes
    it (inside a step such sends took longer; not in the simulation, see the module
    docstring)."""
    pp = groups["pp"]
    pair = groups.topology.group_at("pp", 0)[:2]  # global ranks
    sends: list[float] = []
    receives: list[float] = []
    waking: list[float] = []
    send_cpu: list[float] = []
    receive_cpu: list[float] = []
    out = torch.zeros(shape)
    for waits in [False] * rounds + [True] * rounds:
        dist.barrier()
        if dist.get_rank() == pair[0]:
            works = []
            for _ in range(count):
                _busy(chunk)
                start, cpu = time.perf_counter(), time.thread_time()
                works.append(dist.isend(out, group=pp.process_group, group_dst=1))
                (waking if waits else sends).append(time.perf_counter() - start)
                if not waits:
                    send_cpu.append(time.thread_time() - cpu)
            for work in works:
                work.wait()
        elif dist.get_rank() == pair[1] and waits:
            for _ in range(count):
                dist.irecv(torch.empty(shape), group=pp.process_group, group_src=0).wait()
                _busy(chunk / 2)
        elif dist.get_rank() == pair[1]:
            works = []
            for _ in range(count):
                start, cpu = time.perf_counter(), time.thread_time()
                buffer = torch.empty(shape)
                works.append(dist.irecv(buffer, group=pp.process_group, group_src=0))
                receives.append(time.perf_counter() - start)
                receive_cpu.append(time.thread_time() - cpu)
            _busy(count * chunk)
            for work in works:
                work.wait()
        else:
            _busy(count * chunk)
    means = [
        _slowest(statistics.mean(x) if x else 0.0)
        for x in (sends, receives, waking, send_cpu, receive_cpu)
    ]
    return means[0], means[1], means[2], means[3], means[4]


def _simulation(
    plan: Any, times: dict[tuple[int, str], float], costs: dict[str, Any], cores: float | None
) -> Any:
    """The step ``simulate_pipeline`` predicts. ``cores=None``: a core per rank, with the
    stage times and costs as measured in a loaded step (wall times, the sharing of the cores
    in them). A number: the ranks share that many cores, fed the same computes' and posts'
    CPU times (their time on a core of their own), as overhead each rank's CPU time in the
    step outside its computes, posts and reductions per compute (``host_cpu_per_compute_s``:
    the executor's host work and gloo's threads), the trip with the other ranks waiting (a
    latency: the simulation adds the sharing), the same reduce."""
    n = plan.num_stages
    forward = [times[(s, "F")] for s in range(n)]
    if (0, "W") in times:  # split backwards: B = I + W
        weight = [times[(s, "W")] for s in range(n)]
        backward = [times[(s, "I")] + weight[s] for s in range(n)]
    else:
        backward = [times[(s, "B")] for s in range(n)]
        weight = [0.0] * n
    shared = cores is not None  # CPU times and the unloaded trip; else wall times, loaded
    return simulate_pipeline(
        plan,
        forward=forward,
        backward=backward,
        weight=weight,
        p2p=costs["p2p_unloaded_s" if shared else "p2p_s"],
        overhead=costs["host_cpu_per_compute_s" if shared else "overhead_s"],
        post=costs["send_post_cpu_s" if shared else "send_post_s"],
        receive_post=costs["receive_post_cpu_s" if shared else "receive_post_s"],
        reduce=costs["reduce_s"],
        cores=cores,
    )


def _replicas_simulation(
    plan: Any,
    times: list[dict[tuple[int, str], float]],
    costs: dict[str, Any],
    cores: float,
    pinned: bool,
) -> Any:
    """The step ``simulate_pipeline`` predicts for the dp pipelines together (``dp``): all
    their ranks share the machine's ``cores``, each stage's ``REDUCE_GRAD`` a rendezvous of
    its dp copies. Every input is a CPU time, so that the simulated ranks do the CPU work the
    measured ones did: each replica its own ranks' computes' (``times[d]``) and its stages'
    reductions' (``reduce_cpu_s``: the all-reduce's CPU time, all threads), the posts' as
    in the one-pipeline simulation, and as overhead per compute the rest of each rank's
    CPU time in the step, less the reductions' CPU time (``host_cpu_per_compute_dp_s``)."""
    n = plan.num_stages
    forward = [[t[(s, "F")] for s in range(n)] for t in times]
    if (0, "W") in times[0]:  # split backwards: B = I + W
        weight = [[t[(s, "W")] for s in range(n)] for t in times]
        backward = [
            [t[(s, "I")] + w[s] for s in range(n)] for t, w in zip(times, weight, strict=True)
        ]
    else:
        backward = [[t[(s, "B")] for s in range(n)] for t in times]
        weight = [[0.0] * n for _ in times]
    return simulate_pipeline(
        plan,
        forward=forward,
        backward=backward,
        weight=weight,
        p2p=costs["p2p_unloaded_s"],
        overhead=costs["host_cpu_per_compute_dp_s"],
        post=costs["send_post_cpu_s"],
        receive_post=costs["receive_post_cpu_s"],
        reduce=costs["reduce_cpu_s"],
        cores=cores,
        dp=len(times),
        pinned=pinned,
    )


def _replica_idle(sim: Any, pp: int) -> list[float]:
    """Each simulated rank's idle time in its own pipeline's step (its replica's last end,
    as the benchmark measures a pipeline's step), rank r of replica d at ``d * pp + r``."""
    out = []
    for d in range(len(sim.busy) // pp):
        ranks = range(d * pp, (d + 1) * pp)
        step = max(t.end for r in ranks for t in sim.actions[r])
        out += [step - sim.busy[r] for r in ranks]
    return out


def _case(
    layout: str, name: str, args: argparse.Namespace, rank: int, probe: _Probe
) -> dict[str, Any]:
    pp = LAYOUTS[layout]
    topology = Topology.create(4, pp=pp)
    groups = ProcessGroups(topology)
    v = 1 if name in SINGLE else 2
    plan = plan_pipeline(
        schedule=name,
        microbatches=args.microbatches,
        topology=topology,
        layers=args.layers,
        stages_per_rank=v,
    )
    blocks = gpt_blocks(args.layers, args.width, args.heads, args.vocab, args.seq)
    split = split_model(blocks, plan, groups.group_rank("pp"))
    theirs = {s: copy.deepcopy(m) for s, m in split.stages.items()}
    ours = _Ours(plan, split.stages, groups)
    cpu_times = _CpuTimes(ours.pipe)
    in_step_reduce_cpu = _reduce_cpu_in_step(ours.pipe)
    anchor = _Torch(name, plan, theirs, groups)
    dp_rank = groups.group_rank("dp")
    machine = sorted(os.sched_getaffinity(0))
    cores = len(machine)
    # each replica on cores / dp of its own (where they divide: else every rank on every core)
    pinned = not args.no_pin and groups["dp"].size > 1 and cores % groups["dp"].size == 0
    if pinned:
        share = cores // groups["dp"].size
        _pin(machine[dp_rank * share : (dp_rank + 1) * share])
    data = [
        token_batch(args.batch, args.seq, args.vocab, seed=1000 * r + dp_rank)
        for r in range(args.warmup + args.steps)
    ]
    runners = {"gradsync": ours, "torch": anchor}
    pp_group = groups["pp"].process_group
    times: dict[str, list[float]] = {k: [] for k in runners}
    records, idle, host = [], [], []
    process_cpu: list[float] = []
    thread_cpu: list[float] = []
    for r, (x, y) in enumerate(data):
        order = list(runners) if r % 2 == 0 else list(runners)[::-1]
        timed = r >= args.warmup
        for key in order:
            if key == "gradsync":
                ours.pipe.timeline = [] if timed else None
            dist.barrier()
            start, cpu = time.perf_counter(), (time.process_time(), time.thread_time())
            runners[key].step(x, y)
            if timed and key == "gradsync":  # this rank's CPU time in the step: all threads, main
                process_cpu.append(time.process_time() - cpu[0])
                thread_cpu.append(time.thread_time() - cpu[1])
            elapsed = _slowest(time.perf_counter() - start)
            if timed:
                times[key].append(elapsed)
                if key == "gradsync":
                    # the pipeline's step is its slowest rank's, as in the simulator
                    step_s = torch.tensor([ours.pipe.step_seconds], dtype=torch.float64)
                    dist.all_reduce(step_s, op=dist.ReduceOp.MAX, group=pp_group)
                    timeline = ours.pipe.timeline
                    records.append(timeline)
                    busy = sum(t.end - t.start for t in timeline if t.action.is_compute)
                    host.append(sum(t.end - t.start for t in timeline) - busy)
                    idle.append(float(step_s) - busy)
    ours.pipe.timeline = None
    began = ours.pipe._step_began  # the last timed gradsync step's, on this rank's clock
    shown = [t for t in records[-1] if t.action.is_compute or t.action.kind == "REDUCE_GRAD"]
    reductions = iter(in_step_reduce_cpu[-sum(t.action.kind == "REDUCE_GRAD" for t in shown) :])
    last_step = [  # (action, start, end, CPU time of a reduction), on the machine's clock
        (
            str(t.action),
            began + t.start,
            began + t.end,
            next(reductions) if t.action.kind == "REDUCE_GRAD" else None,
        )
        for t in shown
    ]
    mine, other = ours.weights(), anchor.weights()
    flag = torch.tensor([int(all(torch.equal(p, other[n]) for n, p in mine.items()))])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    equal = bool(flag.item())
    x, y = data[0]
    peaks = {key: _peak_bytes(runner, x, y) for key, runner in runners.items()}
    # The costs besides the computes, each measured on its own (never fitted to the steps).
    ours.pipe.step(x, target=y)  # gradients for REDUCE_GRAD to reduce
    reduce = _reduce_seconds(ours.pipe)
    ours.opt.zero_grad()
    microbatch = (args.batch // args.microbatches, args.seq, args.width)
    post, trip, late = _message_costs(groups, microbatch, loaded=True)
    post_unloaded, trip_unloaded, _ = _message_costs(groups, microbatch, loaded=False)
    send_post, receive_post, waking_post, send_cpu, receive_cpu = _step_posts(groups, microbatch)
    overhead, overhead_cpu = probe.overhead()
    costs: dict[str, Any] = {
        "overhead_s": overhead,
        "overhead_cpu_s": overhead_cpu,
        "send_post_cpu_s": send_cpu,
        "receive_post_cpu_s": receive_cpu,
        "post_s": post,  # back and forth: with p2p, the trip
        "send_post_s": send_post,  # as in a step: what the simulation charges
        "receive_post_s": receive_post,
        "waking_send_post_s": waking_post,  # not in the simulation: see the module docstring
        "p2p_s": max(trip - post, 0.0),  # the sender's post is part of the trip
        "post_unloaded_s": post_unloaded,
        "p2p_unloaded_s": max(trip_unloaded - post_unloaded, 0.0),
        "late_receive_post_s": late,  # not in the simulation: see the module docstring
    }
    stage_times: list[Any] = [None] * 4
    where = (groups.group_rank("dp"), groups.group_rank("pp"))
    dist.all_gather_object(stage_times, (_stage_times(records), reduce, cpu_times.means(), where))
    merged = {k: v for part, _, _, _ in stage_times for k, v in part.items()}
    merged_cpu = {k: v for _, _, part, _ in stage_times for k, v in part.items()}
    costs["reduce_s"] = [  # the slower of a stage's data-parallel copies
        max(part[s][0] for _, part, _, _ in stage_times if s in part)
        for s in range(plan.num_stages)
    ]
    # each replica's own: its ranks' computes' CPU times, its stages' reductions' CPU times
    dp_size = groups["dp"].size
    replica_cpu: list[dict[tuple[int, str], float]] = [{} for _ in range(dp_size)]
    reduce_cpu = [[0.0] * plan.num_stages for _ in range(dp_size)]
    for _, part, cpu_part, (d, _) in stage_times:
        replica_cpu[d].update(cpu_part)
        for s, (_, cpu) in part.items():
            reduce_cpu[d][s] = cpu
    costs["reduce_cpu_s"] = reduce_cpu
    everyone: list[Any] = [None] * 4
    mine = {
        "idle": statistics.median(idle),
        "host": statistics.median(host),
        # CPU time per step: the process (gloo's threads too), its main thread, its computes
        "cpu": (
            statistics.median(process_cpu),
            statistics.median(thread_cpu),
            cpu_times.total() / len(process_cpu),
        ),
        "peaks": peaks,
        "stash": ours.pipe.peak_stash,
        "pp_rank": groups.group_rank("pp"),
        "dp_rank": groups.group_rank("dp"),
        "last_step": last_step,
    }
    dist.all_gather_object(everyone, mine)
    # Each rank's CPU time in the step outside its computes, its posts and its reductions as
    # simulated: the executor's host work, gloo's threads (each message written and read),
    # all ranks' mean per compute; the shared simulation's overhead (the probe's is in it).
    spare, spare_cpu = [], []
    for row in everyone:
        acts = plan.actions[row["pp_rank"]]
        posted = sum(
            costs["send_post_cpu_s"]
            if a.kind in ("SEND_F", "SEND_B")
            else costs["receive_post_cpu_s"]
            for a in acts
            if a.kind in ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
        )
        reduced = sum(costs["reduce_s"][a.stage] for a in acts if a.kind == "REDUCE_GRAD")
        reduced_cpu = sum(
            costs["reduce_cpu_s"][row["dp_rank"]][a.stage] for a in acts if a.kind == "REDUCE_GRAD"
        )
        computes = sum(len(a.leaves) for a in acts if a.is_compute)
        spare.append(max(row["cpu"][0] - row["cpu"][2] - posted - reduced, 0.0) / computes)
        spare_cpu.append(max(row["cpu"][0] - row["cpu"][2] - posted - reduced_cpu, 0.0) / computes)
    costs["host_cpu_per_compute_s"] = statistics.mean(spare)
    # the same with the reductions' CPU time, not their wall time (the dp simulation's)
    costs["host_cpu_per_compute_dp_s"] = statistics.mean(spare_cpu)
    unshared = _simulation(plan, merged, costs, None)
    # The 4 ranks share the machine's cores. At dp 1 one pipeline does; at dp 2 the two
    # pipelines are simulated together (simulate_pipeline's dp): each stage's REDUCE_GRAD
    # waits for its copy in the other pipeline. Beside it, as before: one pipeline on half
    # the cores (two identical pipelines, whose reductions never wait).
    one = _simulation(plan, merged_cpu, costs, cores / dp_size)
    predicted_one = [one.idle[row["pp_rank"]] for row in everyone]
    if dp_size == 1:
        sim, predicted = one, predicted_one
    else:
        sim = _replicas_simulation(plan, replica_cpu, costs, cores, pinned)
        idle_dp = _replica_idle(sim, plan.pp)
        predicted = [idle_dp[row["dp_rank"] * plan.pp + row["pp_rank"]] for row in everyone]
    predicted_host = [
        sim.host[(row["dp_rank"] * plan.pp if dp_size > 1 else 0) + row["pp_rank"]]
        for row in everyone
    ]
    predicted_unshared = [unshared.idle[row["pp_rank"]] for row in everyone]
    step = {k: statistics.median(t) for k, t in times.items()}
    zero = min(row["last_step"][0][1] for row in everyone)
    measured_timeline = [
        [(a, start - zero, end - zero, cpu) for a, start, end, cpu in row["last_step"]]
        for row in everyone
    ]
    simulated_timeline = [
        [
            (str(t.action), t.start, t.end)
            for t in sim.actions[(row["dp_rank"] * plan.pp if dp_size > 1 else 0) + row["pp_rank"]]
            if t.action.is_compute or t.action.kind == "REDUCE_GRAD"
        ]
        for row in everyone
    ]
    _pin(machine)
    return {
        "pinned": pinned,
        "timeline": measured_timeline,
        "simulated_timeline": simulated_timeline,
        "step_s": step,
        "ratio": step["gradsync"] / step["torch"] if "torch" in step else None,
        "bitwise_equal": equal,
        "peak_bytes": {k: [row["peaks"][k] for row in everyone] for k in runners},
        "stash": [row["stash"] for row in everyone],
        "plan_stash": [plan.peak_stash[row["pp_rank"]] for row in everyone],
        "idle_s": [row["idle"] for row in everyone],
        "predicted_idle_s": predicted,
        "host_s": [row["host"] for row in everyone],
        "predicted_host_s": predicted_host,
        **costs,
        "idle_vs_simulated": sum(row["idle"] for row in everyone) / max(sum(predicted), 1e-12),
        "cores": cores,
        "dp": dp_size,
        "predicted_idle_one_pipeline_s": predicted_one,
        "idle_vs_simulated_one_pipeline": sum(row["idle"] for row in everyone)
        / max(sum(predicted_one), 1e-12),
        "step_cpu_s": [row["cpu"] for row in everyone],
        "stage_s": {f"{s}{k}": t for (s, k), t in sorted(merged.items())},
        "stage_cpu_s": {f"{s}{k}": t for (s, k), t in sorted(merged_cpu.items())},
        "stage_cpu_replicas_s": [
            {f"{s}{k}": t for (s, k), t in sorted(replica.items())} for replica in replica_cpu
        ],
        "predicted_idle_unshared_s": predicted_unshared,
        "idle_vs_simulated_unshared": sum(row["idle"] for row in everyone)
        / max(sum(predicted_unshared), 1e-12),
    }


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        results = {}
        probe = _Probe(args.microbatches)
        for layout in args.layouts:
            for name in args.schedules:
                results[f"{layout}/{name}"] = _case(layout, name, args, rank, probe)
        if rank == 0:
            out.put(results)
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: spawn the ranks, print the table, return the figures."""
    results = spawn_ranks(worker, args)
    print(
        f"GPT {args.layers} x {args.width} ({args.heads} heads, vocab {args.vocab}, seq "
        f"{args.seq}), batch {args.batch} per pipeline in {args.microbatches} microbatches, "
        f"4 gloo ranks, SGD"
    )
    print(
        f"{'layout / schedule':<34}{'gradsync ms':>12}{'torch ms':>10}{'ratio':>8}  bitwise  "
        "stash (plan)   idle ms per rank: measured / simulated (all)   peak MiB gradsync / torch"
    )
    figures: dict[str, Any] = {"bench": "torch_pipeline"}
    ratios = []
    for key, r in results.items():
        step = r["step_s"]
        theirs = f"{step['torch'] * 1e3:>10.1f}" if "torch" in step else f"{'-':>10}"
        ratio = f"{r['ratio']:>7.3f}x" if r["ratio"] is not None else f"{'n/a':>8}"
        idle = "  ".join(
            f"{m * 1e3:.1f}/{p * 1e3:.1f}"
            for m, p in zip(r["idle_s"], r["predicted_idle_s"], strict=True)
        )
        peaks = "  ".join(
            "/".join(f"{r['peak_bytes'][k][i] / MIB:.1f}" for k in r["peak_bytes"])
            for i in range(4)
        )
        stash = ",".join(map(str, r["stash"])) + f" ({','.join(map(str, r['plan_stash']))})"
        equal = {True: "yes", False: "NO", None: "-"}[r["bitwise_equal"]]
        one = (
            f"; {'pinned' if r['pinned'] else 'not pinned'}"
            f"; one pipeline on {r['cores'] / r['dp']:g} cores "
            f"{r['idle_vs_simulated_one_pipeline']:.2f}x"
            if r["dp"] > 1
            else ""
        )
        print(
            f"{key:<34}{step['gradsync'] * 1e3:>12.1f}{theirs}{ratio}  {equal:<7}  "
            f"{stash:<14} {idle} ({r['idle_vs_simulated']:.2f}x{one}; a core per rank "
            f"{r['idle_vs_simulated_unshared']:.2f}x)   {peaks}"
        )
        if r["ratio"] is not None:
            ratios.append(r["ratio"])
        figures[key] = r
    print(
        "costs measured apart from the steps (us: overhead per compute, post of a send / a "
        "receive as in a step (simulated; a send to a waiting receiver), post back and "
        "forth (late receive), p2p (with the others waiting); ms: REDUCE_GRAD per stage, "
        "wall (the slower copy) / CPU time of each replica's copy), "
        "and each rank's host time in the step (posts and reductions, ms: measured / "
        "simulated); us, the CPU time of the overhead / a send's post / a receive's post "
        "(what the simulation with cores takes):"
    )
    for key, r in results.items():
        reduce = (
            " ".join(f"{t * 1e3:.2f}" for t in r["reduce_s"])
            + " / "
            + " | ".join(
                " ".join(f"{t * 1e3:.2f}" for t in replica) for replica in r["reduce_cpu_s"]
            )
        )
        host = "  ".join(
            f"{m * 1e3:.1f}/{p * 1e3:.1f}"
            for m, p in zip(r["host_s"], r["predicted_host_s"], strict=True)
        )
        print(
            f"  {key:<32}{r['overhead_s'] * 1e6:>7.0f}"
            f"{r['send_post_s'] * 1e6:>7.0f} /{r['receive_post_s'] * 1e6:>4.0f}"
            f" ({r['waking_send_post_s'] * 1e6:.0f})"
            f"{r['post_s'] * 1e6:>7.0f} ({r['late_receive_post_s'] * 1e6:.0f})"
            f"{r['p2p_s'] * 1e6:>7.0f} ({r['p2p_unloaded_s'] * 1e6:.0f})   {reduce}   {host}"
            f"   {r['overhead_cpu_s'] * 1e6:.0f} / {r['send_post_cpu_s'] * 1e6:.0f} / "
            f"{r['receive_post_cpu_s'] * 1e6:.0f}"
        )
    print(
        "the simulation's cores (the machine's, shared by every pipeline's ranks) and each "
        "stage's "
        "compute, ms, in the step (wall) / its thread's CPU time (what the simulation with "
        "cores takes):"
    )
    for key, r in results.items():
        stages = "  ".join(
            f"{k} {t * 1e3:.2f}/{r['stage_cpu_s'].get(k, float('nan')) * 1e3:.2f}"
            for k, t in r["stage_s"].items()
        )
        print(f"  {key:<32}{r['cores']:>5g}   {stages}")
    print(
        "each rank's CPU time in gradsync's step (ms): the process, all its threads / its main "
        "thread / its computes (their thread's)"
    )
    for key, r in results.items():
        cpu = "  ".join("/".join(f"{t * 1e3:.1f}" for t in row) for row in r["step_cpu_s"])
        print(
            f"  {key:<34}{cpu}   host per compute {r['host_cpu_per_compute_s'] * 1e6:.0f} us "
            f"(less the reductions' CPU time, not wall: "
            f"{r['host_cpu_per_compute_dp_s'] * 1e6:.0f} us)"
        )
    if args.timeline:
        print(
            "the last timed step, rank by rank (ms from the first compute's start on any rank): "
            "each compute and REDUCE_GRAD, measured start-end (a reduction's CPU time, all "
            "threads), then simulated"
        )
        for key, r in results.items():
            print(f"  {key}")
            for rank, (got, sim) in enumerate(
                zip(r["timeline"], r["simulated_timeline"], strict=True)
            ):
                print(f"    rank {rank} measured   " + _chart(got))
                print(f"    rank {rank} simulated  " + _chart(sim))
    figures["ratio_vs_anchor"] = statistics.median(ratios)
    figures["stash_equals_plan"] = all(r["stash"] == r["plan_stash"] for r in results.values())
    return figures


def _chart(actions: list[Any]) -> str:
    """One rank's computes and reductions as ``name start-end``, ms (a reduction's CPU time
    in brackets, where measured)."""
    out = []
    for name, start, end, *cpu in actions:
        extra = f" ({cpu[0] * 1e3:.1f} cpu)" if cpu and cpu[0] is not None else ""
        out.append(f"{name} {start * 1e3:.0f}-{end * 1e3:.0f}{extra}")
    return "  ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, few rounds")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=None, help="default 256 (--quick: 64)")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=None, help="default 128 (--quick: 32)")
    parser.add_argument("--batch", type=int, default=16, help="sequences per pipeline")
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument(
        "--schedules", nargs="+", choices=SCHEDULES, default=SCHEDULES, help="default: all"
    )
    parser.add_argument(
        "--layouts", nargs="+", choices=tuple(LAYOUTS), default=tuple(LAYOUTS), help="default: all"
    )
    parser.add_argument(
        "--no-pin",
        action="store_true",
        help="at dp > 1, leave every rank on every core (default: each replica's ranks "
        "pinned to cores / dp of their own)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="print each rank's last timed step, measured and simulated",
    )
    add_repeat_arg(parser)
    args = parser.parse_args()
    args.world_size = 4
    args.width = args.width or (64 if args.quick else 256)
    args.seq = args.seq or (32 if args.quick else 128)
    args.steps = args.steps or (3 if args.quick else 10)
    args.warmup = 1 if args.quick else args.warmup
    runs = run_repeats(lambda index: measure(args), args.repeat)
    finish(runs, ratio_keys=("ratio_vs_anchor",))


if __name__ == "__main__":
    main()
