"""``gradsync calibrate`` for torch: time each collective over every group size of the world.

Every rank runs the same collectives the executors run (``all_reduce``, ``all_gather_into_tensor``,
``reduce_scatter_tensor`` (``fully_shard``'s), ``reduce_scatter_into`` (ZeRO-2's buckets: the
profile's ``bucket_reduce_scatter``), ``broadcast``, an ``isend``/``irecv`` pair), on every group
size that divides the world, all groups of a size at once (as a data-parallel or HSDP step runs
them), at a few message sizes. A collective's time is the median over the repeats of its group's
slowest rank's, averaged over the groups of its size; ``gradsync_core``'s ``fit_link`` turns each
(collective, group size) into latency and bus bandwidth. The executors' host work per collective and
per step is measured through the executors themselves on a tiny model (``host.py``), and the memory
each collective allocates beside its buffers (``collective_scratch``). Under ``torchrun`` it
measures the job's ranks (gloo or NCCL); otherwise ``calibrate_local`` spawns gloo ranks on this
machine.
"""

from __future__ import annotations

import datetime
import gc
import os
import platform
import queue
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from gradsync_core.plan import COLLECTIVES, LinkCost, MachineProfile, fit_link
from gradsync_torch._collectives import (
    all_gather_single,
    reduce_scatter_into,
    reduce_scatter_single,
)
from gradsync_torch.cost.host import Probe, host_overheads, message_posts

KIB, MIB = 1024, 1024 * 1024
# 256 bytes: a latency-bound collective (fully_shard's agreement checks gather 32 bytes a rank),
# which a line through the larger sizes alone can overstate by twice on a loaded CPU
DEFAULT_SIZES = (256, 16 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
DEFAULT_REPEATS = 5
PROBE_ROUNDS = 15  # timed steps of each executor probe (host.py): its slope needs a few more
_POLL_S = 1.0
_TIMEOUT_S = 600.0
Samples = dict[tuple[str, int], list[tuple[int, float]]]


def _group_sizes(world: int) -> list[int]:
    return [g for g in range(2, world + 1) if world % g == 0]


def _subgroup(world: int, size: int) -> Any:
    """This rank's group of ``size`` consecutive ranks (every rank creates every group)."""
    if size == world:
        return dist.group.WORLD
    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)))
        if first <= dist.get_rank() < first + size:
            mine = group
    return mine


def _run(
    collective: str, group: Any, size: int, nbytes: int, device: torch.device
) -> tuple[float, float]:
    """One collective of ``nbytes`` (the whole buffer) over ``group``: the seconds its
    asynchronous call took to return, and until it was done."""
    numel = max(size, nbytes // 4 // size * size)
    rank = dist.get_rank(group)
    _synchronize()
    start = time.perf_counter()
    if collective == "p2p":  # a round trip between the pair's two ranks: half is one message
        peer = dist.get_global_rank(group, 1 - rank)
        buffer = _buffer(numel, device)
        first, second = (dist.send, dist.recv) if rank == 0 else (dist.recv, dist.send)
        first(buffer, peer, group=group)
        second(buffer, peer, group=group)
        _synchronize()
        return 0.0, (time.perf_counter() - start) / 2
    work = _issue(collective, group, size, numel, device)
    issued = time.perf_counter() - start
    work.wait()
    _synchronize()
    return issued, time.perf_counter() - start


def _issue(collective: str, group: Any, size: int, numel: int, device: torch.device) -> Any:
    """Start one collective of ``numel`` elements (the whole buffer); returns its work."""
    if collective == "all_reduce":
        return dist.all_reduce(_buffer(numel, device), group=group, async_op=True)
    if collective == "all_gather":
        out, inp = _buffer(numel, device), _buffer(numel // size, device)
        return all_gather_single(out, inp, group=group, async_op=True)
    if collective == "reduce_scatter":
        out, inp = _buffer(numel // size, device), _buffer(numel, device)
        return reduce_scatter_single(out, inp, group=group, async_op=True)
    if collective == "bucket_reduce_scatter":  # ZeRO-2's buckets (data_parallel, zero/flat.py)
        out, inp = _buffer(numel // size, device), _buffer(numel, device)
        return reduce_scatter_into(out, inp, group)
    src = dist.get_global_rank(group, 0)
    return dist.broadcast(_buffer(numel, device), src=src, group=group, async_op=True)


_BUFFERS: dict[tuple[int, str], torch.Tensor] = {}


def _buffer(numel: int, device: torch.device) -> torch.Tensor:
    key = (numel, str(device))
    if key not in _BUFFERS:
        if len(_BUFFERS) > 8:
            _BUFFERS.clear()
        _BUFFERS[key] = torch.ones(numel, device=device)
    return _BUFFERS[key]


def measure(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    collectives: Sequence[str] = COLLECTIVES,
) -> tuple[Samples, Samples]:
    """Time every collective on every group size of the initialized world; every rank calls
    it and gets ``{(collective, group size): [(nbytes, seconds), ...]}`` twice: the time to
    completion and the time its call took to return, per size each group's slowest rank's
    median, averaged over the groups of that size (``_group_slowest``)."""
    world = dist.get_world_size()
    device = _device()
    out: Samples = {}
    issue: Samples = {}
    for size in _group_sizes(world):
        group = _subgroup(world, size)
        for collective in collectives:
            if collective == "p2p" and size != 2:
                continue
            for nbytes in sizes:
                _run(collective, group, size, nbytes, device)  # warm-up: connections, buffers
                issued, times = [], []
                for _ in range(repeats):
                    dist.barrier()
                    start, done = _run(collective, group, size, nbytes, device)
                    issued.append(start)
                    times.append(done)
                numel = max(size, nbytes // 4 // size * size)
                key = (collective, size)
                done_s = _group_slowest(statistics.median(times), size)
                out.setdefault(key, []).append((numel * 4, done_s))
                if collective != "p2p":
                    slowest = _group_slowest(statistics.median(issued), size)
                    issue.setdefault(key, []).append((numel * 4, slowest))
    _BUFFERS.clear()
    return out, issue


def collective_scratch(nbytes: int = MIB) -> dict[str, float]:
    """Bytes each collective allocates beside its buffers while in flight, per byte of its
    whole buffer (gloo's ``all_gather_into_tensor`` allocates its output again and
    ``reduce_scatter_tensor`` clones its input; NCCL works in place): the most bytes the
    allocator held at once during one collective of ``nbytes`` over the world, the largest
    rank's. Every rank calls it."""
    device = _device()
    world = dist.get_world_size()
    numel = max(world, nbytes // 4 // world * world)
    full, part = torch.ones(numel, device=device), torch.ones(numel // world, device=device)
    calls = {
        "all_reduce": lambda: dist.all_reduce(full, async_op=True),
        "all_gather": lambda: all_gather_single(full, part, async_op=True),
        "reduce_scatter": lambda: reduce_scatter_single(part, full, async_op=True),
        "bucket_reduce_scatter": lambda: reduce_scatter_into(part, full, None),
        "broadcast": lambda: dist.broadcast(full, src=0, async_op=True),
    }
    out = {}
    for kind, call in calls.items():
        call().wait()  # warm-up: the backend's first call may set up buffers it keeps
        dist.barrier()
        held = _allocated_during(lambda call=call: call().wait(), device)
        out[kind] = _slowest(held / (numel * 4))
    return out


def _allocated_during(run: Any, device: torch.device) -> int:
    """The most bytes allocated at once while ``run()`` ran, beyond what was there before."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated(device) - before)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    return live_peak(cpu_allocations(prof))


def cpu_allocations(prof: Any) -> list[tuple[int, int, int]]:
    """Every CPU allocation and free a finished ``torch.profiler.profile(profile_memory=True)``
    recorded, as ``(time ns, address, bytes)`` in time order (a free's bytes negative).

    A copy a collective makes of its input inside its c10d operator (gloo's
    ``reduce_scatter_tensor`` clones it) is held by the collective's work, which an executor
    waits for before it frees the input (``fully_shard``'s reduce-scatter); gloo's worker
    thread, which the profiler does not watch, often drops that work last, so the copy's
    free goes unrecorded (``live_peak``). Such a copy is counted freed with its input when
    the profile recorded the operators' inputs (``record_shapes=True``).
    """
    out = []
    copies: list[tuple[int, int, int, int]] = []  # (its id, address, bytes, its input's id)
    frees: dict[int, int] = {}  # allocation id -> when its free was recorded
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag != _EventType.Allocation:
            continue
        fields = event.typed[1]
        if fields.device.type != "cpu":
            continue
        out.append((event.start_time_ns, fields.ptr, fields.alloc_size))
        if fields.alloc_size < 0:
            frees[fields.allocation_id] = event.start_time_ns
            continue
        source = _collective_copy_of(event)
        if source is not None:
            copies.append((fields.allocation_id, fields.ptr, fields.alloc_size, source))
    for copy, address, nbytes, source in copies:
        freed = frees.get(source)
        if freed is not None and frees.get(copy, freed + 1) > freed:
            out.append((freed, address, -nbytes))
    return sorted(out, key=lambda a: a[0])


def _collective_copy_of(allocation: Any) -> int | None:
    """The allocation id of the tensor ``allocation`` copies, if it is made by an
    ``aten::clone`` inside a c10d collective's operator (and the profile kept the inputs)."""
    op = allocation.parent
    while op is not None and op.name != "aten::clone":
        op = op.parent
    if op is None:
        return None
    outer = op.parent
    while outer is not None and not outer.name.startswith("c10d::"):
        outer = outer.parent
    if outer is None:
        return None
    for value in op.typed[1].inputs:
        source = getattr(value, "allocation_id", None)
        if source is not None:
            return int(source)
    return None


def live_peak(allocations: Sequence[tuple[int, int, int]], start_ns: int | None = None) -> int:
    """The most bytes live at once from ``allocations`` (``(time ns, address, bytes)``, in
    time order, a free's bytes negative), counted from the first, the peak taken from
    ``start_ns`` on.

    The profiler records an allocation's free only on a thread it profiles: a tensor handed
    to a gloo collective is often freed on gloo's worker thread, once the collective's work
    object drops it after the caller's last reference, and that free goes unrecorded (a
    running sum then keeps the buffer forever: ``DataParallel``'s 8 MiB broadcast buffer
    showed up in steps long after). So the live set is kept by address: an allocation at an
    address still live means the block there was freed first.

    Example:
        >>> lost = [(0, 64, 8), (1, 96, 4), (2, 64, 8), (3, 96, -4)]  # 64's free unrecorded
        >>> live_peak(lost), sum(n for _, _, n in lost[:3])
        (12, 20)
    """
    live: dict[int, int] = {}
    total = peak = 0
    for t, address, nbytes in allocations:
        if nbytes > 0:
            total += nbytes - live.get(address, 0)
            live[address] = nbytes
        elif address in live:
            total -= live.pop(address)
        if start_ns is None or t >= start_ns:
            peak = max(peak, total)
    return peak


def copy_bandwidth(nbytes: int = 16 * MIB, repeats: int = DEFAULT_REPEATS) -> float:
    """Bytes per second of a copy within this rank's device, every rank copying at once (as
    they do in a step); the slowest rank's median."""
    device = _device()
    src, dst = _buffer(nbytes // 4, device), torch.empty(nbytes // 4, device=device)
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        _synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        _synchronize()
        times.append(time.perf_counter() - start)
    return nbytes / _slowest(statistics.median(times[1:]))


MAX_SLOWDOWN = 1000.0  # compute and a collective that do not overlap at all


SLOWDOWN_KINDS = (
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "bucket_reduce_scatter",
    "broadcast",
)


def overlap_slowdowns(
    nbytes: int = MIB, repeats: int = 3, *, measure: bool | None = None
) -> dict[str, float]:
    """How many times longer compute takes while a collective of each kind is in flight
    beside it, as the timeline uses the figure: the one that gives compute and a collective
    started together the time they take together (``MachineProfile.overlap_slowdowns``).

    For each kind of ``SLOWDOWN_KINDS``, ``nbytes`` over the world: the collective alone
    (``A``), a matrix-multiply loop about twice as long alone (``C``), then both, the
    collective issued and the loop run while it is in flight (``F``, until both are done);
    each the slowest rank's median. ``slowdown_of_pair`` turns them into the figure.

    Where the ranks' compute threads fill the node's cores (gloo, ``oversubscribed()``), a
    collective's threads get a core only when its rank stops computing, and no figure is
    measured: every kind is ``MAX_SLOWDOWN`` (compute hides nothing). Measured there, the pair
    is no guide: on a 2-core machine with 2 or 4 ranks the share a repeat hid ranged from 0 to
    1 for the same kind and size, and the steps ``benchmarks/cost_model.py`` measures matched
    the timeline without overlap better than with the pairs' mean share (docs/cost-model.md).
    ``measure``: measure the pairs (True) or not (False) whatever the node; None decides by
    ``oversubscribed()``.
    """
    if measure is None:
        measure = not oversubscribed()
    if not measure:
        return {kind: MAX_SLOWDOWN for kind in SLOWDOWN_KINDS}
    device = _device()
    world = dist.get_world_size()
    a = torch.randn(256, 256, device=device)

    def work(count: int) -> float:
        _synchronize()
        start = time.perf_counter()
        for _ in range(count):
            a.mm(a)
        _synchronize()
        return time.perf_counter() - start

    work(4)
    one = _slowest(statistics.median(work(4) / 4 for _ in range(repeats)))
    numel = max(world, nbytes // 4 // world * world)
    group = dist.group.WORLD
    figures = {}
    for kind in SLOWDOWN_KINDS:
        _run(kind, group, world, nbytes, device)  # warm-up
        alone_runs = []
        for _ in range(repeats):
            dist.barrier()
            alone_runs.append(_run(kind, group, world, nbytes, device)[1])
        count = max(1, round(2 * _slowest(statistics.median(alone_runs)) / one))
        hidden = []  # each repeat's share of the collective that compute hid: 1 / its figure
        for _ in range(repeats):
            dist.barrier()
            alone = _slowest(_run(kind, group, world, nbytes, device)[1])
            dist.barrier()
            compute = _slowest(work(count))
            dist.barrier()
            _synchronize()
            start = time.perf_counter()
            handle = _issue(kind, group, world, numel, device)
            work(count)
            handle.wait()
            _synchronize()
            together = _slowest(time.perf_counter() - start)
            hidden.append(1 / slowdown_of_pair(alone, compute, together))
        figures[kind] = mean_slowdown(hidden)
    return figures


def compute_cores() -> int | None:
    """How many ranks of this node compute at full speed at once (``MachineProfile.cores``):
    the cores this process may run on over its compute threads (``torch.get_num_threads()``),
    for CPU ranks; None for GPU ranks (each computes on its own device)."""
    if _nccl():
        return None
    affinity = getattr(os, "sched_getaffinity", None)
    cores = len(affinity(0)) if affinity is not None else (os.cpu_count() or 1)
    return max(1, cores // torch.get_num_threads())


def oversubscribed() -> bool:
    """Whether the ranks' compute fills this node's cores, so that a collective's threads
    (gloo's) run only when their rank waits: CPU ranks, and the node's ranks
    (``LOCAL_WORLD_SIZE``, else the world) at least ``compute_cores()``. Every rank calls it
    and gets the same answer (any rank's yes)."""
    cores = compute_cores()
    if cores is None:
        return False
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
    return _slowest(float(ranks >= cores)) > 0


def mean_slowdown(hidden: Sequence[float]) -> float:
    """The figure of several measurements, each given as ``1 / slowdown`` (the share of the
    collective compute hid): the mean share, inverted. A step's exposed time beside compute is
    ``A * (1 - 1/s)``, linear in the share, so its mean is the share to expect; a median of
    the figures would jump between rounds that overlapped and rounds that did not.

    Example:
        >>> round(mean_slowdown([1 / 1000, 1.0]), 3)  # half the runs hid nothing, half all
        1.998
    """
    return min(MAX_SLOWDOWN, 1 / max(statistics.fmean(hidden), 1 / MAX_SLOWDOWN))


def slowdown_of_pair(collective_s: float, compute_s: float, together_s: float) -> float:
    """The ``overlap_slowdown`` under which the cost model's timeline gives a collective of
    ``collective_s`` and compute of ``compute_s``, started together, the measured
    ``together_s`` until both are done.

    The timeline slows compute ``s`` times while the collective is in flight, so the pair
    takes ``C + A * (1 - 1/s)`` once the compute outlasts the collective's slowed share
    (``C * s > A``), and ``max(A, C)`` at best: ``s = A / (A + C - F)``, 1 when the pair took no
    longer than the longer of the two (they overlapped fully), ``MAX_SLOWDOWN`` when it took
    ``C + A`` or more (they did not overlap at all).

    Example:
        >>> slowdown_of_pair(1.0, 2.0, 2.0), slowdown_of_pair(1.0, 2.0, 2.5)
        (1.0, 2.0)
        >>> slowdown_of_pair(1.0, 2.0, 3.1)
        1000.0
    """
    longer = max(collective_s, compute_s)
    if together_s <= longer:
        return 1.0
    hidden = collective_s + compute_s - together_s  # what of the collective compute hid
    if hidden <= collective_s / MAX_SLOWDOWN:
        return MAX_SLOWDOWN
    return min(MAX_SLOWDOWN, max(1.0, collective_s / hidden))


def _group_slowest(seconds: float, size: int) -> float:
    """Each group's slowest rank's ``seconds`` (groups of ``size`` consecutive ranks, as
    ``_subgroup`` makes them), averaged over the groups: a collective over a group is done
    when that group's ranks are, not when the other groups' (running beside it, and sharing
    the machine with it) are. The largest over the world would charge every collective of a
    small group the worst of all groups' noise: at 4 gloo ranks on 2 cores the fitted
    latency of a 64-byte all-gather over 2 ranks ranged 1.15-2.02 ms between runs, where a
    probe of one group took 0.8-0.9 ms. Every rank calls it and gets the same figure."""
    world = dist.get_world_size()
    mine = torch.tensor([seconds], dtype=torch.float64, device=_device())
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    times = [float(t.item()) for t in every]
    return statistics.fmean(max(times[g : g + size]) for g in range(0, world, size))


def _slowest(seconds: float) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu")


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def _synchronize() -> None:
    if _nccl():
        torch.cuda.synchronize()


def profile_from(
    samples: Samples,
    issue: Samples,
    *,
    ranks_per_node: int,
    name: str,
    source: str,
    copy: float | None = None,
    slowdowns: Mapping[str, float] | None = None,
    probe: Mapping[tuple[str, int], float] | None = None,
    world_size: int | None = None,
    scratch: Mapping[str, float] | None = None,
    posts: Mapping[str, float] | None = None,
    cores: int | None = None,
) -> MachineProfile:
    """The machine profile of measured samples: one fitted link per collective and size;
    ``slowdowns``: ``overlap_slowdowns()``, their median the figure of the kinds not measured
    (point-to-point); with the executor ``probe``'s step times (``host.Probe.times()`` over
    ``world_size`` ranks), the host overheads too (``host.host_overheads``); ``scratch``:
    ``collective_scratch()``; ``posts``: ``host.message_posts()``, the pipeline runtime's
    host time per message; ``cores``: ``compute_cores()``."""
    links: list[LinkCost] = [
        fit_link(collective, size, points, issue=issue.get((collective, size), ()))
        for (collective, size), points in sorted(samples.items())
    ]
    profile = MachineProfile(
        name=name,
        ranks_per_node=ranks_per_node,
        links=tuple(links),
        source=source,
        copy_bandwidth=copy,
        overlap_slowdown=statistics.median(slowdowns.values()) if slowdowns else 1.0,
        overlap_slowdowns=dict(slowdowns or {}),
        collective_scratch=dict(scratch or {}),
        post_s=dict(posts or {}),
        cores=cores,
    )
    if probe is None:
        return profile
    world = world_size or max(size for _, size in samples)
    host_s, step_host_s = host_overheads(probe, profile, world)
    return replace(profile, host_s=host_s, step_host_s=step_host_s)


def _describe(world: int, elapsed: float) -> str:
    backend = dist.get_backend()
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return (
        f"gradsync calibrate: torch {torch.__version__} {backend}, {world} ranks on "
        f"{platform.node()} ({os.cpu_count()} CPUs), {when}, {elapsed:.1f} s"
    )


def calibrate(
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    ranks_per_node: int | None = None,
    name: str | None = None,
) -> MachineProfile | None:
    """Calibrate the initialized process group; every rank calls it.

    Args:
        sizes: message sizes in bytes (the whole buffer of each collective).
        repeats: timed runs per size (the median counts).
        ranks_per_node: default ``LOCAL_WORLD_SIZE`` (torchrun's), else the world.
        name: the profile's name (default: the host and backend).

    Returns:
        The machine profile on rank 0, ``None`` on the other ranks.

    Raises:
        RuntimeError: no process group is initialized.
        ValueError: a world of one rank (nothing to measure), or samples no line fits.
    """
    if not dist.is_initialized():
        raise RuntimeError("calibrate needs torch.distributed: run it under torchrun")
    world = dist.get_world_size()
    if world < 2:
        raise ValueError(
            "calibrate needs 2 ranks or more; start it with torchrun --nproc_per_node 2"
        )
    start = time.perf_counter()
    samples, issue = measure(sizes=sizes, repeats=repeats)
    copy = copy_bandwidth(repeats=repeats)
    slowdowns = overlap_slowdowns(repeats=repeats)
    scratch = collective_scratch()
    probe = Probe(_device())
    for _ in range(max(PROBE_ROUNDS, repeats)):
        probe.round()
    posts = message_posts(_device())
    if dist.get_rank() != 0:
        return None
    per_node = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return profile_from(
        samples,
        issue,
        ranks_per_node=per_node,
        name=name or f"{platform.node()} {dist.get_backend()}",
        source=_describe(world, time.perf_counter() - start),
        copy=copy,
        slowdowns=slowdowns,
        probe=probe.times(),
        world_size=world,
        scratch=scratch,
        posts=posts,
        cores=compute_cores(),
    )


def _worker(rank: int, world: int, store_path: str, options: dict[str, Any], out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        profile = calibrate(**options)
        if profile is not None:
            out.put(profile.to_json())
        dist.barrier()
    except ValueError as err:  # what the fit refuses: one sentence in the parent, no traceback
        out.put({"error": str(err)})
    finally:
        dist.destroy_process_group()
        gc.collect()


def calibrate_local(
    world_size: int,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    name: str | None = None,
) -> MachineProfile:
    """Spawn ``world_size`` gloo ranks on this machine and calibrate them.

    Raises:
        ValueError: a world below 2, or samples no line fits (the ranks' own sentence).
        RuntimeError: a rank failed otherwise, or no result came within 10 minutes.
    """
    if not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"calibrate needs a world of 2 ranks or more, got {world_size!r}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    options = {"sizes": tuple(sizes), "repeats": repeats, "name": name}
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, options, out))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            result = _wait(out, procs)
            for p in procs:
                if "error" not in result:
                    p.join()
        finally:
            for p in procs:
                if p.is_alive():
                    p.terminate()
                    p.join()
    if "error" in result:
        raise ValueError(result["error"])
    return MachineProfile.from_json(result)


def _wait(out: Any, procs: list[Any]) -> Any:
    waited = 0.0
    while waited < _TIMEOUT_S:
        try:
            return out.get(timeout=_POLL_S)
        except queue.Empty:
            waited += _POLL_S
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise RuntimeError(
                f"a calibration rank exited with code {failed[0]}; see its traceback"
            )
    raise RuntimeError(f"no calibration result within {_TIMEOUT_S:.0f} s")


def calibrate_command(
    *, world_size: int | None, sizes: Sequence[int], repeats: int, name: str | None
) -> MachineProfile | None:
    """The ``gradsync.calibrate`` entry point: under ``torchrun`` (``RANK`` set) every rank of
    the job measures (NCCL when CUDA is available, else gloo) and rank 0 returns the profile;
    otherwise ``world_size`` gloo ranks are spawned here (default 2)."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        try:
            return calibrate(sizes=sizes, repeats=repeats, name=name)
        finally:
            dist.barrier()
            dist.destroy_process_group()
            gc.collect()
    return calibrate_local(world_size or 2, sizes=sizes, repeats=repeats, name=name)
