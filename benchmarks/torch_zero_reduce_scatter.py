"""gloo reduce-scatter of one bucket: the candidates ``reduce_scatter_into`` chose between.

docs/design.md §11: every candidate runs in the same process tree, alternating round by round
(the order rotates every round); each figure is the median over the timed rounds of the
slowest rank's time. The anchor is torch's ``reduce_scatter_tensor`` (what NCCL runs).

    reduce_scatter_tensor   torch 2.13's single-tensor collective on gloo (the anchor)
    reduce_scatter (list)   torch's list form
    reduce per owner        one asynchronous ``reduce`` per chunk owner
    all_to_all + sum        ``all_to_all_single`` into a bucket-sized buffer, then a local sum
    ring (p2p)              N-1 steps of ``isend``/``irecv`` of one chunk (at 2 ranks: the
                            pairwise exchange ``reduce_scatter_into`` uses, no scratch buffer)
    reduce_scatter_into     gradsync_torch._collectives' pick for this world size

    python benchmarks/torch_zero_reduce_scatter.py                  # 25 MiB, 2 ranks
    python benchmarks/torch_zero_reduce_scatter.py --world-size 4 --mib 4
    python benchmarks/torch_zero_reduce_scatter.py --repeat 3       # median and range

The last line is one JSON object: {"bench": "torch_zero_reduce_scatter", "ratio_vs_anchor":
(reduce_scatter_into / reduce_scatter_tensor), "ms": {candidate: median ms}, ...}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks

from gradsync_torch._collectives import reduce_scatter_into

ANCHOR = "reduce_scatter_tensor"


def candidates(send: torch.Tensor, out: torch.Tensor, rank: int, ws: int) -> dict[str, Callable]:
    """Each candidate leaves this rank's summed chunk in ``out`` (``send`` is scratch)."""
    c = out.numel()
    recv, tmp = torch.empty_like(send), torch.empty_like(out)

    def per_owner() -> None:
        for h in [dist.reduce(send[r * c : (r + 1) * c], r, async_op=True) for r in range(ws)]:
            h.wait()
        out.copy_(send[rank * c : (rank + 1) * c])

    def all_to_all() -> None:
        dist.all_to_all_single(recv, send)
        torch.sum(recv.view(ws, -1), 0, out=out)

    def ring() -> None:
        cur = send[((rank - 1) % ws) * c : ((rank - 1) % ws + 1) * c]
        for s in range(ws - 1):
            idx = (rank - s - 2) % ws
            handles = [dist.isend(cur, (rank + 1) % ws), dist.irecv(tmp, (rank - 1) % ws)]
            for h in handles:
                h.wait()
            cur = out if s == ws - 2 else torch.empty_like(out)
            torch.add(send[idx * c : (idx + 1) * c], tmp, out=cur)

    return {
        ANCHOR: lambda: dist.reduce_scatter_tensor(out, send),
        "reduce_scatter (list)": lambda: dist.reduce_scatter(out, list(send.chunk(ws))),
        "reduce per owner": per_owner,
        "all_to_all + sum": all_to_all,
        "ring (p2p)": ring,
        "reduce_scatter_into": lambda: reduce_scatter_into(out, send, None).wait(),
    }


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
    chunk = int(args.mib * 2**20) // 4 // world_size
    source = torch.randn(chunk * world_size, generator=torch.Generator().manual_seed(rank))
    send, result = source.clone(), torch.empty(chunk)
    expected = source.clone()
    dist.all_reduce(expected)
    expected = expected[rank * chunk : (rank + 1) * chunk]
    runs = candidates(send, result, rank, world_size)
    names, times = list(runs), {name: [] for name in runs}
    for name in names:  # warm up, and check each candidate's sum
        send.copy_(source)
        runs[name]()
        torch.testing.assert_close(result, expected, msg=name)
    for round_ in range(args.warmup + args.steps):
        shift = round_ % len(names)
        for name in names[shift:] + names[:shift]:
            send.copy_(source)
            dist.barrier()
            start = time.perf_counter()
            runs[name]()
            took = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(took, op=dist.ReduceOp.MAX)
            if round_ >= args.warmup:
                times[name].append(took.item())
    if rank == 0:
        out.put({name: statistics.median(ts) for name, ts in times.items()})
    dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    medians = spawn_ranks(worker, args)
    anchor = medians[ANCHOR]
    print(
        f"gloo reduce-scatter of {args.mib} MiB fp32, {args.world_size} ranks, median of "
        f"{args.steps} rounds (slowest rank)"
    )
    print(f"{'candidate':24}{'ms':>9}{'vs anchor':>11}")
    for name, t in medians.items():
        print(f"{name:24}{t * 1e3:9.1f}{t / anchor:10.2f}x")
    return {
        "bench": "torch_zero_reduce_scatter",
        "ratio_vs_anchor": round(medians["reduce_scatter_into"] / anchor, 3),
        "ms": {name: round(t * 1e3, 2) for name, t in medians.items()},
        "world_size": args.world_size,
        "mib": args.mib,
        "steps": args.steps,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_repeat_arg(parser)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mib", type=float, default=25.0, help="bucket size (default 25)")
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 15)")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    if args.steps is None:
        args.steps = 6 if args.quick else 15
    runs = run_repeats(lambda _: measure(args), args.repeat)
    return finish(runs, ("ratio_vs_anchor",))


if __name__ == "__main__":
    main()
