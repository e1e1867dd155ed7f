"""Does the machine share its cores among runnable processes as processor sharing predicts?

The check behind ``simulate_pipeline(cores=...)`` (docs/pipeline.md, "The simulator"): each
process runs a fixed amount of work (a count of 256 x 256 matrix products on one thread),
after sleeping a given time (a sleeping process uses no core). The work is calibrated alone
(one second of it on a core of its own), then run in mixes; each process's wall time is
printed beside what processor sharing predicts (while k processes are runnable on C cores,
each runs at ``min(1, C / k)`` of its speed) and what a core per process would give.

    python benchmarks/core_sharing.py

Run it on a quiet machine: other load takes cores too.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import torch

SIZE = 256


def _products(n: int) -> None:
    a = torch.randn(SIZE, SIZE)
    for _ in range(n):
        torch.mm(a, a)


def _job(n: int, delay: float, start: float, out: mp.Queue, i: int) -> None:
    torch.set_num_threads(1)
    _products(1)  # warm
    while time.perf_counter() < start:
        time.sleep(0.0005)
    if delay:
        time.sleep(delay)
    _products(n)
    out.put((i, time.perf_counter() - start))


def run(jobs: list[tuple[int, float]]) -> list[float]:
    """Each job's wall time from the common start, for ``(products, sleep first)`` jobs."""
    out: mp.Queue = mp.Queue()
    start = time.perf_counter() + 2.0
    procs = [mp.Process(target=_job, args=(n, d, start, out, i)) for i, (n, d) in enumerate(jobs)]
    for p in procs:
        p.start()
    times = sorted(out.get() for _ in procs)
    for p in procs:
        p.join()
    return [round(t, 3) for _, t in times]


def main() -> None:
    mp.set_start_method("fork")
    cores = len(os.sched_getaffinity(0))
    print(f"cores {cores}, load {os.getloadavg()[0]:.2f}")
    rate = 2000 / run([(2000, 0.0)])[0]
    w = int(rate)  # one second of work alone
    print(f"alone: {rate:.0f} products/s; one unit of work = {w} products (1 s alone)")
    mixes = [
        ("2 x 1", [(w, 0.0)] * 2),
        ("4 x 1", [(w, 0.0)] * 4),
        ("2 x 1 + 2 x 0.5", [(w, 0.0)] * 2 + [(w // 2, 0.0)] * 2),
        ("2 x 1 + (sleep 0.5, then 0.5)", [(w, 0.0)] * 2 + [(w // 2, 0.5)]),
        ("3 x 1", [(w, 0.0)] * 3),
    ]
    for name, jobs in mixes:
        shared = _processor_sharing([n / w for n, _ in jobs], [d for _, d in jobs], cores)
        own = [round(n / w + d, 3) for n, d in jobs]
        got = run(jobs)
        print(f"{name:<30} measured {got}  processor sharing {shared}  a core each {own}")
    print(f"load {os.getloadavg()[0]:.2f}")


def _processor_sharing(work: list[float], delay: list[float], cores: int) -> list[float]:
    """Each job's end under processor sharing: event to event, k runnable jobs each at
    ``min(1, cores / k)`` of their speed."""
    left, end, now = list(work), [0.0] * len(work), 0.0
    while any(x > 0 for x in left):
        runnable = [i for i, x in enumerate(left) if x > 0 and delay[i] <= now]
        rate = min(1.0, cores / len(runnable)) if runnable else 0.0
        wakes = [d - now for i, d in enumerate(delay) if left[i] > 0 and d > now]
        step = min([left[i] / rate for i in runnable] + wakes)
        for i in runnable:
            left[i] -= step * rate
            if left[i] <= 1e-12:
                left[i], end[i] = 0.0, now + step
        now += step
    return [round(t, 3) for t in end]


if __name__ == "__main__":
    main()
