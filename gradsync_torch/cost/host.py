"""The executors' host overhead per collective and per step, measured through the executors.

A collective issued by ``DataParallel``, ``ZeroRedundancyOptimizer`` or ``fully_shard`` costs
the step more than the wire: the hooks that decide to issue it, the copies' Python, the
bookkeeping, and the ranks' skew where it is waited for. ``gradsync calibrate`` measures that
cost directly, on a tiny model whose compute is negligible and whose messages are 1 KiB, so a
collective's wire time is its fitted latency: each executor runs the model with ``SHORT`` and
``LONG`` blocks (one collective or three per block), beside the plain model. Per block, the
executor's extra time less the machine profile's own cost of its collectives (issue, wire,
copies: what the timeline already charges) is the host time of its collectives (``host_s``);
what is left at zero blocks is the step's bookkeeping (``step_host_s``: DDP's used-map
all-reduce and its agreement check; ``fully_shard``'s, less its two phase checks' all-gathers,
which the timeline charges). Nothing here looks at the
step times the cost model is checked against.

- ``DataParallel(overlap=False)``, one bucket per block: an all-reduce each.
- ``ZeroRedundancyOptimizer`` beside it, every block's weight broadcast alone: a broadcast.
- ``fully_shard`` per block (``reshard_after_forward``): two all-gathers and a reduce-scatter,
  one host time for both kinds (their hooks are alike; they are not told apart).

A pipeline's messages are measured through its runtime's own message code
(``gradsync_torch.pipeline.p2p.Messages``, ``message_posts``): the host time of posting one
send and one receive of an activation as a step posts them, the machine's ``post_s``.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Mapping

import torch
import torch.distributed as dist
from torch import nn

from gradsync_core.plan import MachineProfile
from gradsync_torch.data_parallel import DataParallel
from gradsync_torch.param_sharding import fully_shard
from gradsync_torch.pipeline.p2p import Messages
from gradsync_torch.zero import ZeroRedundancyOptimizer

SHORT, LONG = 2, 10  # blocks of the two probe models
WIDTH = 16  # a block's weight: 16 x 16 fp32, 1 KiB
ROWS = 4
PATHS = ("plain", "data_parallel", "zero1", "zero3")
# the 1-in-1e6 MiB cap puts every weight in a bucket (and a broadcast) of its own
_TINY_CAP_MB = 1e-6
Times = dict[tuple[str, int], float]


class _Blocks(nn.Module):
    """``blocks`` of ``tanh(x @ w)``, without biases: one parameter per block."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _step_fn(path: str, blocks: int, device: torch.device) -> Callable[[], None]:
    """One training step of the probe model under ``path``'s executor (built here, on every
    rank in the same order: the executors agree on their plans collectively)."""
    net = _Blocks(blocks).to(device)
    x = torch.randn(ROWS, WIDTH, device=device)
    model: nn.Module = net
    sync: Callable[[], None] | None = None
    if path in ("data_parallel", "zero1"):
        wrapper = DataParallel(net, bucket_cap_mb=_TINY_CAP_MB, overlap=False)
        model, sync = wrapper, wrapper.sync_gradients
    if path == "zero3":
        for layer in net.layers:
            fully_shard(layer)
        fully_shard(net)
    opt: torch.optim.Optimizer
    if path == "zero1":
        opt = ZeroRedundancyOptimizer(
            net.named_parameters(), torch.optim.Adam, bucket_cap_mb=_TINY_CAP_MB
        )
    else:
        opt = torch.optim.Adam(net.parameters(), foreach=True)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        if sync is not None:
            sync()
        opt.step()

    return step


class Probe:
    """The probe models under every executor, built once; ``round()`` times one step of each
    (the slowest rank's) and keeps it; ``times()`` gives each one's median so far. Every rank
    calls both, at the same points."""

    def __init__(self, device: torch.device, warmup: int = 3) -> None:
        self.device = device
        self.steps = {(p, n): _step_fn(p, n, device) for n in (SHORT, LONG) for p in PATHS}
        self.samples: dict[tuple[str, int], list[float]] = {key: [] for key in self.steps}
        for step in self.steps.values():
            for _ in range(warmup):  # DataParallel rebuilds its buckets after the first
                step()

    def round(self) -> None:
        keys = list(self.steps)
        turn = len(self.samples[keys[0]]) % len(keys)  # a rotating order: no key always first
        for key in keys[turn:] + keys[:turn]:
            dist.barrier()
            self._synchronize()
            start = time.perf_counter()
            self.steps[key]()
            self._synchronize()
            self.samples[key].append(_slowest(time.perf_counter() - start, self.device))

    def times(self) -> Times:
        return {key: statistics.median(seconds) for key, seconds in self.samples.items()}

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()


def _slowest(seconds: float, device: torch.device) -> float:
    t = torch.tensor([seconds], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def host_overheads(
    times: Mapping[tuple[str, int], float], machine: MachineProfile, world_size: int
) -> tuple[dict[str, float], dict[str, float]]:
    """``(host_s, step_host_s)`` from the probe's median step times.

    Args:
        times: ``{(path, blocks): seconds}`` for every path of ``PATHS`` at ``SHORT`` and
            ``LONG`` blocks (``Probe.times()``).
        machine: the profile fitted from the raw collectives (its links, issue costs and copy
            bandwidth: what the timeline charges a collective already).
        world_size: the ranks the probe ran on.

    Returns:
        Seconds per collective kind (never below 0) and per executor path's step.

    Example:
        >>> from gradsync_core.plan import LinkCost
        >>> links = tuple(LinkCost(collective=c, group_size=None, latency_s=1e-4,
        ...               bus_bandwidth=1e12) for c in ("all_reduce", "all_gather",
        ...               "reduce_scatter", "broadcast"))
        >>> m = MachineProfile(name="toy", ranks_per_node=2, links=links)
        >>> t = {("plain", n): 1e-3 for n in (SHORT, LONG)}
        >>> t |= {("data_parallel", n): 1e-3 + n * 3e-4 + 2e-3 for n in (SHORT, LONG)}
        >>> t |= {("zero1", n): t["data_parallel", n] + n * 1e-4 for n in (SHORT, LONG)}
        >>> t |= {("zero3", n): 1e-3 + n * 6e-4 + 5e-3 for n in (SHORT, LONG)}
        >>> host, step = host_overheads(t, m, 2)
        >>> {k: round(v * 1e6) for k, v in host.items()}  # microseconds
        {'all_reduce': 200, 'broadcast': 0, 'all_gather': 100, 'reduce_scatter': 100}
        >>> {k: round(v * 1e6) for k, v in step.items()}  # zero3: less two checks of 0.1 ms
        {'data_parallel': 2000, 'zero3': 4800}
    """
    nbytes = WIDTH * WIDTH * 4
    shard = -(-WIDTH // world_size) * WIDTH * 4  # a rank's rows of one weight, padded

    def charged(kind: str, size: int, copies: int) -> float:
        """What the timeline already charges one collective of the probe."""
        return (
            machine.time(kind, size, world_size)
            + machine.issue_time(kind, size, world_size)
            + copies * machine.copy_time(size)
        )

    def per_block(path: str, than: str = "plain") -> tuple[float, float]:
        """The slope and intercept over blocks of ``path``'s time beyond ``than``'s."""
        short = times[path, SHORT] - times[than, SHORT]
        long = times[path, LONG] - times[than, LONG]
        slope = (long - short) / (LONG - SHORT)
        return slope, short - SHORT * slope

    ddp_slope, ddp_step = per_block("data_parallel")
    all_reduce = ddp_slope - charged("all_reduce", nbytes, 2)  # copied in and out
    broadcast = per_block("zero1", "data_parallel")[0] - charged("broadcast", nbytes, 0)
    z3_slope, z3_step = per_block("zero3")
    z3_charged = 2 * charged("all_gather", shard * world_size, 1)
    z3_charged += charged("reduce_scatter", shard * world_size, 1)
    units = (z3_slope - z3_charged) / 3
    # fully_shard checks the forward and the backward once each (a blocking all-gather of a
    # digest per rank): the timeline charges them, so the step's bookkeeping is what is left
    digest = hashlib.sha256().digest_size  # what agree_on gathers from each rank
    z3_step -= 2 * charged("all_gather", digest * world_size, 0)
    host = {
        "all_reduce": max(0.0, all_reduce),
        "broadcast": max(0.0, broadcast),
        "all_gather": max(0.0, units),
        "reduce_scatter": max(0.0, units),
    }
    step = {"data_parallel": max(0.0, ddp_step), "zero3": max(0.0, z3_step)}
    return host, step


def _busy(seconds: float, device: torch.device) -> None:
    """Compute on this rank for ``seconds`` (products of 128 x 128 matrices)."""
    a = torch.randn(128, 128, device=device)
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        a.mm(a)


def message_posts(
    device: torch.device,
    *,
    shape: tuple[int, ...] = (8, 512),
    count: int = 16,
    rounds: int = 3,
    chunk: float = 0.004,
) -> dict[str, float]:
    """The host time of posting one pipeline message, through the pipeline runtime's own
    ``Messages`` (``{"send": s, "receive": s}``, each the slower rank's mean: the machine's
    ``post_s``); every rank calls it.

    Ranks 0 and 1 are stages 0 and 1 of a two-stage pipeline (a group of their own, as the
    runtime makes one). As a step on gloo does, rank 1 posts its ``count`` receives of
    ``shape`` first (``post_forward`` and ``issue``: the buffer allocated, ``irecv``
    returning), then computes while they arrive; rank 0 sends one after each ``chunk`` of
    computing (``send_forward`` and ``issue``); every other rank computes, as in a step, where
    the ranks share the machine's cores. A round before the timed ones agrees the edge's
    shapes (the runtime's first step).
    """
    pair = dist.new_group([0, 1])
    meta = dist.new_group([0, 1], backend="gloo")
    rank = dist.get_rank()
    messages = Messages(pair, meta, (0, 1), device) if rank < 2 else None
    out = torch.zeros(shape, device=device)
    sends: list[float] = []
    receives: list[float] = []
    for timed in [False] + [True] * rounds:
        dist.barrier()
        if messages is not None and rank == 0:
            for mb in range(count):
                _busy(chunk, device)
                start = time.perf_counter()
                messages.send_forward(0, mb, [out])
                messages.issue()
                if timed:
                    sends.append(time.perf_counter() - start)
        elif messages is not None:
            for mb in range(count):
                start = time.perf_counter()
                messages.post_forward(1, mb)
                messages.issue()
                if timed:
                    receives.append(time.perf_counter() - start)
            _busy(count * chunk, device)
            for mb in range(count):
                messages.wait("F", 1, mb)
        else:
            _busy(count * chunk, device)
        if messages is not None:
            messages.finish()
    send = statistics.mean(sends) if sends else 0.0
    receive = statistics.mean(receives) if receives else 0.0
    return {"send": _slowest(send, device), "receive": _slowest(receive, device)}
