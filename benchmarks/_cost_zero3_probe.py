"""Where a 2-rank ZeRO-3 step of ``cost_model.py``'s model spends its time (issue 38, a probe).

Two gloo ranks (one thread each, as the benchmark's), the benchmark's model (8 blocks of
``gelu(Linear(512, 512))``, 32 rows a rank, Adam). Prints, on rank 0, medians in ms:

- the plain step and ``fully_shard``'s (``reshard_after_forward`` and kept), split into
  forward, backward, optimizer step and the whole step;
- one 1 MiB all-gather and one reduce-scatter alone, each after a barrier (as calibration
  times them);
- a forward written by hand as ``fully_shard`` runs it: 8 times (wait for this unit's
  all-gather, issue the next one's, compute the block), with fixed or new output buffers and
  the gathered weight copied out, and the gathers alone, and the compute alone.

    python benchmarks/_cost_zero3_probe.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost_torch import Net, square_loss

from gradsync_torch import fully_shard

WIDTH, LAYERS, ROWS = 512, 8, 32


def _median_ms(fn: Callable[[], object], runs: int = 18, skip: int = 3) -> float:
    times = []
    for _ in range(runs):
        dist.barrier()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times[skip:]) * 1e3


def _phases(net: nn.Module, x: torch.Tensor, steps: int = 15) -> list[float]:
    """Median forward, backward, optimizer step and whole step, ms."""
    opt = torch.optim.Adam(net.parameters(), foreach=True)
    marks = []
    for i in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = square_loss(net(x))
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        if i >= 3:
            marks.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0))
    return [statistics.median(m[k] for m in marks) * 1e3 for k in range(4)]


def _by_hand(
    x: torch.Tensor,
    blocks: list[nn.Linear],
    shard: torch.Tensor,
    fixed: list[torch.Tensor],
    *,
    alloc: bool,
    copy: bool,
    compute: bool,
) -> None:
    """fully_shard's forward without fully_shard: each unit's gather waited for, the next
    one issued, then the block (``fixed``: the gathers' outputs when not ``alloc``)."""
    h = x
    out = torch.empty(WIDTH * WIDTH) if alloc else fixed[0]
    handle = dist.all_gather_into_tensor(out, shard, async_op=True)
    for i in range(LAYERS):
        handle.wait()
        current = out
        if i < LAYERS - 1:
            out = torch.empty(WIDTH * WIDTH) if alloc else fixed[i + 1]
            handle = dist.all_gather_into_tensor(out, shard, async_op=True)
        if copy:
            current.view(WIDTH, WIDTH).clone()
        if compute:
            h = nn.functional.gelu(blocks[i](h))


def worker(rank: int, world: int, port: int) -> None:
    warnings.filterwarnings("ignore")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    x = torch.randn(ROWS, WIDTH)
    rows: dict[str, list[float]] = {"plain": _phases(Net(LAYERS, WIDTH), x)}
    for reshard in (True, False):
        net = Net(LAYERS, WIDTH)
        for layer in net.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(net, reshard_after_forward=reshard)
        rows["fully_shard " + ("reshard" if reshard else "keep")] = _phases(net, x)
    shard, whole = torch.randn(WIDTH * WIDTH // world), torch.empty(WIDTH * WIDTH)
    rows["all-gather 1 MiB alone"] = [_median_ms(lambda: dist.all_gather_into_tensor(whole, shard))]
    rows["reduce-scatter 1 MiB alone"] = [
        _median_ms(lambda: dist.reduce_scatter_tensor(shard, whole))
    ]
    blocks = [nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)]
    fixed = [torch.empty(WIDTH * WIDTH) for _ in range(LAYERS)]
    for name, alloc, copy, compute in (
        ("by hand: fixed buffers", False, False, True),
        ("by hand: new buffers", True, False, True),
        ("by hand: new buffers, copied out", True, True, True),
        ("by hand: the gathers alone", True, True, False),
    ):
        rows[name] = [
            _median_ms(
                lambda a=alloc, c=copy, k=compute: _by_hand(
                    x, blocks, shard, fixed, alloc=a, copy=c, compute=k
                )
            )
        ]

    def plain_forward() -> None:
        h = x
        for block in blocks:
            h = nn.functional.gelu(block(h))

    rows["by hand: the compute alone"] = [_median_ms(plain_forward)]
    if rank == 0:
        print("ms: forward, backward, optimizer, step (or one figure)")
        for name, figures in rows.items():
            print(f"{name:36s}", " ".join(f"{v:7.2f}" for v in figures), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(worker, args=(2, 29535), nprocs=2)
