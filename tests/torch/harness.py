"""Spawn harness for multi-process torch tests on gloo (docs/design.md §10).

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes, each with a gloo
process group over a FileStore, calls ``fn(rank, world_size, *args)`` and returns the results
in rank order. A worker's exception is re-raised in the parent with the worker's traceback;
a worker that hangs is killed after ``timeout`` seconds. Spawns cost seconds, so run many
checks inside one worker rather than one spawn per assertion.
"""

from __future__ import annotations

import os
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    args: tuple[Any, ...],
) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        try:
            results.put((rank, None, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
    except BaseException:  # report everything, including assertion failures
        results.put((rank, traceback.format_exc(), None))


def run_workers(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_entry, args=(fn, rank, world_size, store_path, results, args))
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str | None, Any]] = {}
        try:
            while len(outcomes) < world_size:
                try:
                    rank, error, value = results.get(timeout=timeout)
                except queue.Empty:
                    missing = sorted(set(range(world_size)) - set(outcomes))
                    raise TimeoutError(
                        f"ranks {missing} of {world_size} did not finish in {timeout:.0f} s "
                        f"(finished: {sorted(outcomes)})"
                    ) from None
                outcomes[rank] = (error, value)
                if error is not None:
                    break  # the other ranks may now hang in a collective
        finally:
            for p in procs:
                p.join(timeout=5 if len(outcomes) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
    failed = {r: e for r, (e, _) in outcomes.items() if e is not None}
    if failed:
        rank, error = min(failed.items())
        raise AssertionError(f"rank {rank} of {world_size} failed:\n{error}")
    return [outcomes[r][1] for r in range(world_size)]
