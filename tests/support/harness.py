"""Spawn harness for multi-process torch tests on gloo (docs/design.md §10).

``run_workers(fn, world_size, *args)`` starts ``world_size`` processes, each with a gloo
process group over a FileStore, calls ``fn(rank, world_size, *args)`` and returns the results
in rank order. A worker's exception is re-raised in the parent with the worker's traceback;
a worker that hangs is killed after ``timeout`` seconds. Spawns cost seconds, so run many
checks inside one worker rather than one spawn per assertion.

Ranks start from a fork server (``multiprocessing``'s "forkserver": a fresh interpreter, not
a copy of this one, which has imported torch and gradsync_torch once; each rank is a fork of
it). Spawning each rank cold paid those imports, ~2 s of CPU, per rank, on 2 cores shared
by every rank (test_agreement.py and test_resumable_sampler.py, -n 0: 60 s -> 13 s). A rank
is still a clean process: the server never ran a test or initialized a process group; it
has the environment of this process when its first ``run_workers`` started the server
(tests/conftest.py's settings, set at import), and each rank takes this process's working
directory and ``sys.path`` as under "spawn".

Inside a worker, ``run_checks`` runs named checks in order and agrees across the ranks on
each one's outcome (passed, failed, or skipped with ``Skip``), so one spawn reports many checks
and the parent's test asserts on each by name.

Fault tests pass ``pg_timeout_s`` (the process group's collective timeout, so a rank waiting
for a dead peer fails in seconds instead of torch's default 30 minutes) and call
``run_workers_outcomes``, which expects ranks to die and reports how each one ended.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import queue
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once in the fork server, so every rank starts with them (a module missing here is
# imported by the rank itself, as under "spawn").
_PRELOAD = ["torch", "torch.distributed", "torch.multiprocessing", "gradsync_torch"]


def _context() -> Any:
    """The multiprocessing context the ranks start in: a fork server with torch imported."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # effective until the server first starts
    return ctx


def _entry(
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    store_path: str,
    results: Any,
    args: tuple[Any, ...],
    pg_timeout_s: float | None = None,
) -> None:
    try:
        torch.set_num_threads(1)
        store = dist.FileStore(store_path, world_size)
        timeout = (
            {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
        )
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, **timeout)
        try:
            # Every rank connected before any runs: gloo's init returns on a rank once its side
            # of the mesh is up, and a rank whose fn ends at once destroyed the group while a
            # peer was still connecting ("Gloo connectFullMesh failed ... Connection closed by
            # peer" on the peer: 3 of 60 spawns of test_harness.py's failing-rank case, load 11).
            dist.barrier()
            results.put((rank, None, fn(rank, world_size, *args)))
        finally:
            dist.destroy_process_group()
            # A clean end (README, "Ending a torch run"): gloo's threads stop only when the
            # last object holding the group is collected; one left to exit can abort the
            # process (SIGABRT) after a peer died, as the fault tests make one do.
            gc.collect()
    except BaseException:  # report everything, including assertion failures
        results.put((rank, traceback.format_exc(), None))


def _start(
    ctx: Any,
    fn: Callable[..., Any],
    world_size: int,
    tmp: str,
    results: Any,
    args: tuple[Any, ...],
    pg_timeout_s: float | None,
) -> list[Any]:
    """Start one process per rank, all rendezvousing through a FileStore in ``tmp``."""
    store_path = os.path.join(tmp, "store")
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, rank, world_size, store_path, results, args),
            kwargs={"pg_timeout_s": pg_timeout_s},
        )
        for rank in range(world_size)
    ]
    for p in procs:
        p.start()
    return procs


SKIPPED = "skipped: "


class Skip(Exception):
    """Raised by a check that does not apply here (``Skip("DDP itself refuses it: ...")``):
    ``run_checks`` records ``"skipped: <reason>"``, which is not a pass."""


def run_checks(
    checks: Iterable[tuple[str, Callable[[], Any]]], *, keep_going: bool = False
) -> dict[str, str | None]:
    """Run named checks in order on this rank; ``{name: None, the failure, or "skipped: why"}``.

    After each check the ranks agree (one all-reduce) whether it failed or was skipped
    anywhere, so every rank reports the same outcome: a check skipped on some ranks only, or
    failed on another rank, is a failure here too. After the first failure the checks after
    it are marked not run, because the ranks may be out of step; with ``keep_going`` they run
    (for checks that each start afresh and end in step even when they fail, such as one
    model per case). A test asserts the dict holds no failure, listing them all; a test whose
    checks may skip reports ``"skipped: ..."`` as pytest's skip.
    """
    results: dict[str, str | None] = {}
    failed = False
    world_size = dist.get_world_size()
    for name, check in checks:
        if failed and not keep_going:
            results[name] = "not run: an earlier check failed"
            continue
        try:
            check()
            results[name] = None
        except Skip as why:
            results[name] = f"{SKIPPED}{why}"
        except Exception:
            results[name] = traceback.format_exc()
        here = results[name]
        skipped_here = here is not None and here.startswith(SKIPPED)
        failed_here = here is not None and not skipped_here
        counts = torch.tensor([failed_here, skipped_here], dtype=torch.int32)
        dist.all_reduce(counts)
        failures, skips = (int(c) for c in counts)
        if failures and here is None:
            results[name] = "passed here, failed on another rank"
        elif not failures and 0 < skips < world_size:
            results[name] = f"{'skipped' if skipped_here else 'passed'} here, not on every rank"
        failed = failed or failures > 0 or 0 < skips < world_size
    return results


def run_workers(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 180.0,
    pg_timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; results by rank."""
    ctx = _context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = _start(ctx, fn, world_size, tmp, results, args, pg_timeout_s)
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


class Outcome(NamedTuple):
    """How one spawned rank ended."""

    exitcode: int | None  # 0 after fn returned or raised; what os._exit gave; None if killed
    error: str | None  # the traceback of what fn raised
    value: Any  # what fn returned


def run_workers_outcomes(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 60.0,
    pg_timeout_s: float | None = None,
) -> list[Outcome]:
    """Run ``fn`` like ``run_workers``, for tests in which ranks die on purpose.

    Waits until every process has ended (killing those alive after ``timeout`` seconds) and
    returns each rank's ``Outcome`` instead of raising: a rank that called ``os._exit`` has
    its exit code and no value.
    """
    ctx = _context()
    results = ctx.Queue()
    reported: dict[int, tuple[str | None, Any]] = {}

    def drain(wait_s: float) -> bool:
        try:
            rank, error, value = results.get(timeout=wait_s)
        except queue.Empty:
            return False
        reported[rank] = (error, value)
        return True

    with tempfile.TemporaryDirectory() as tmp:
        procs = _start(ctx, fn, world_size, tmp, results, args, pg_timeout_s)
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
                drain(0.1)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        while drain(0.5):  # what a rank sent just before it ended
            pass
    return [Outcome(p.exitcode, *reported.get(rank, (None, None))) for rank, p in enumerate(procs)]


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A gloo world of one, this process, for checks that need a group but no peers."""
    with tempfile.TemporaryDirectory() as tmp:
        store = dist.FileStore(os.path.join(tmp, "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
