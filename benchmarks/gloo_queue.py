"""Does a blocking collective wait behind an asynchronous one on the same gloo group?

The check behind the cost model's queued agreement checks (docs/cost-model.md, "ZeRO-3 and
HSDP"): ``fully_shard``'s runtime agreement issues a blocking 32-byte all-gather per rank
while a 4 MiB all-gather it started asynchronously may still run on the same group. Each
rank times, after a barrier each: the small all-gather alone, the large one alone, and the
small one issued right after the large one was started (``async_op=True``), then the wait
for the large one. If the group's work runs in order, the third figure is close to the sum
of the first two.

    python benchmarks/gloo_queue.py                 # 2 gloo ranks, 25 rounds
    python benchmarks/gloo_queue.py --world-size 4 --rounds 40

Run it on a quiet machine; rank 0 prints the median of the rounds after the first 5.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from _spawn import spawn_ranks

SMALL_BYTES = 32
LARGE_FLOATS = 1 << 20  # 4 MiB of float32 per rank
WARMUP = 5
# torch 2.13 names the tensor all-gather ``all_gather_single``; older releases, only the old name
all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    torch.set_num_threads(1)
    large = torch.randn(LARGE_FLOATS)
    large_out = torch.empty(world * LARGE_FLOATS)
    small = torch.zeros(SMALL_BYTES, dtype=torch.uint8)
    small_out = torch.empty(world * SMALL_BYTES, dtype=torch.uint8)
    times: dict[str, list[float]] = {
        "small alone": [],
        "large alone": [],
        "small behind large": [],
        "large, then its wait": [],
    }
    for _ in range(args.rounds):
        dist.barrier()
        t = time.perf_counter()
        all_gather(small_out, small)
        times["small alone"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        all_gather(large_out, large)
        times["large alone"].append(time.perf_counter() - t)
        dist.barrier()
        t = time.perf_counter()
        work = all_gather(large_out, large, async_op=True)
        issued = time.perf_counter()
        all_gather(small_out, small)
        times["small behind large"].append(time.perf_counter() - issued)
        assert work is not None
        work.wait()
        times["large, then its wait"].append(time.perf_counter() - t)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        out.put({name: statistics.median(ts[WARMUP:]) for name, ts in times.items()})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=25)
    args = parser.parse_args()
    if args.rounds <= WARMUP:
        parser.error(f"--rounds must be above the {WARMUP} warm-up rounds")
    medians = spawn_ranks(worker, args)
    print(f"gloo_queue: {args.world_size} ranks, median of {args.rounds - WARMUP} rounds")
    for name, seconds in medians.items():
        print(f"  {name:<22} {seconds * 1e3:7.3f} ms")


if __name__ == "__main__":
    main()
