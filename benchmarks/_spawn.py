"""Run a torch benchmark's ranks as spawned processes and collect rank 0's result.

A rank that dies (an exception, a gloo abort) would leave the others waiting in a collective
and the parent waiting on the queue for half an hour; so the parent polls the queue and the
processes, and stops everything as soon as one rank has exited with an error. Each rank ends
as the README's "clean end" says: after its worker returns (and destroyed its process group),
a ``gc.collect()`` lets gloo's threads stop before the interpreter exits; left to interpreter
shutdown, one of them can abort the process ("terminate called without an active
exception", seen once in ~20 repeats of benchmarks/torch_zero.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import queue
import tempfile
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

POLL_S = 1.0


def spawn_ranks(
    worker: Callable[..., None], args: argparse.Namespace, timeout_s: float = 1800.0
) -> Any:
    """Start ``worker(rank, world_size, store_path, args, out)`` for every rank; return what
    rank 0 puts on ``out``.

    Raises:
        SystemExit: a rank exited with a non-zero code, or no result came in ``timeout_s``.
    """
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=_rank_main, args=(worker, r, args.world_size, store, args, out))
            for r in range(args.world_size)
        ]
        for p in procs:
            p.start()
        try:
            result = _wait_for_result(out, procs, timeout_s)
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise SystemExit(f"a benchmark rank exited with code {p.exitcode}")
        finally:
            for p in procs:  # only ours, and only those still running after a failure
                if p.is_alive():
                    p.terminate()
                    p.join()
    return result


def _rank_main(worker: Callable[..., None], *args: Any) -> None:
    worker(*args)
    gc.collect()  # the objects holding the process group, before interpreter shutdown


def _wait_for_result(out: Any, procs: list[Any], timeout_s: float) -> Any:
    waited = 0.0
    while waited < timeout_s:
        try:
            return out.get(timeout=POLL_S)
        except queue.Empty:
            waited += POLL_S
        failed = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
        if failed:
            raise SystemExit(f"a benchmark rank exited with code {failed[0]}; see its traceback")
    raise SystemExit(f"no result from the benchmark ranks within {timeout_s:.0f} s")
