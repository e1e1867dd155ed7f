"""The torch side of ``async_save.py``: gloo ranks train, and every save method saves the
same state in turn while the training goes on (docs/design.md §11: one process tree, the
variants alternating round by round, the order rotating).

The training: the benchmarks' ``mlp`` under gradsync's ``DataParallel`` and ZeRO-1
``ZeroRedundancyOptimizer(Adam)``. The state saved is the weights plus each rank's Adam state:

    gradsync, blocking          opt.save(path, model=module)
    gradsync, blocking=False    opt.save(path, model=module, blocking=False), its writer process
                                paced at ``--writer-share`` of a core (gradsync's default,
                                ``WRITER_SHARE``, unless given)
    gradsync, unpaced           the same with the writer unpaced (``set_writer_share(1.0)``)
    DCP save                    torch.distributed.checkpoint.save of the same tensors: the
                                weights (replicated, so DCP writes each once) and each rank's
                                Adam state under its own keys
    DCP async, thread           dcp.async_save(..., async_checkpointer_type=THREAD)
    DCP async, process          dcp.async_save(..., async_checkpointer_type=PROCESS)
    writer: thread              the writer alone, as gradsync's runs: the rank file's tensors
                                (the rank's Adam state and the weights it stores) copied into
                                a reused host buffer, then written and hashed
                                (``write_rank_file``) by a writer thread of the training
                                process, started once and told what to write over a queue
    writer: process             the same file from the same buffer in shared memory, written
                                by a writer process started once (as DCP's process mode
                                starts one), told what to write over a pipe, and written as
                                gradsync's writer process writes it (around the page cache:
                                ``write_atomic(..., direct=True)``)

The two writer variants are issue 39's "thread or process" measured on the same bytes: they
differ only in where the write runs (no agreement, manifest or switch in either).

Per save: the time it blocked the training (the call, the slowest rank), then a fixed number of
training steps, each marked in flight when the save had not ended on some rank as it started,
then the wait. Quiet steps (no save in flight) run before each save.

Two figures of the steps during a save: ``slowdown``, the median step in flight over the median
quiet step (issue 39's target), and ``total_slowdown``, the whole stretch from the save's call
to the end of its wait (the blocked time, the fixed number of steps after it and the wait for
the save's end) over as many quiet steps: it does not move with how many steps a save's length
puts in flight, and a save that the training starves shows in its wait. ``save_s``: the save's
wall time, call to end (gradsync's background saves: the handle's end; the others: when the
training first saw it done, to a step).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import queue
import shutil
import statistics
import threading
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _torch_models import build_model, count_params, loss_of, make_batch
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from gradsync_core.checkpoint import (
    WRITER_NICE,
    TensorBytes,
    model_owners,
    rank_file,
    set_writer_share,
    tensor_file,
    write_atomic,
    write_rank_file,
)
from gradsync_torch import DataParallel, ZeroRedundancyOptimizer
from gradsync_torch.checkpoint.staging import StagingBuffer, tensor_bytes

SYNC = "gradsync, blocking"
ASYNC = "gradsync, blocking=False"
UNPACED = "gradsync, unpaced"
DCP_SYNC = "DCP save"
DCP_THREAD = "DCP async, thread"
DCP_PROCESS = "DCP async, process"
WRITER_THREAD = "writer: thread"
WRITER_PROCESS = "writer: process"
VARIANTS = (
    SYNC,
    ASYNC,
    UNPACED,
    DCP_SYNC,
    DCP_THREAD,
    DCP_PROCESS,
    WRITER_THREAD,
    WRITER_PROCESS,
)
BACKGROUND = (ASYNC, UNPACED, DCP_THREAD, DCP_PROCESS, WRITER_THREAD, WRITER_PROCESS)


class _Ended:
    """The handle of a save that ended when its call returned."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        return None


class _Future:
    """DCP's future as a handle."""

    def __init__(self, future: Any) -> None:
        self.future = future

    def done(self) -> bool:
        return bool(self.future.done())

    def wait(self) -> None:
        self.future.result()


class _Request:
    """A rank file asked of the writer thread; done once written."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None

    def done(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.error is not None:
            raise self.error


class _WriterThread:
    """The writer in a thread started once, as the writer process is: it writes rank files
    on request, so that the two variants differ only in thread against process."""

    def __init__(self) -> None:
        self.requests: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        _nice()
        while (item := self.requests.get()) is not None:
            write, request = item
            try:
                write()
            except BaseException as e:  # raised at wait()
                request.error = e
            request.event.set()

    def submit(self, write: Any) -> _Request:
        request = _Request()
        self.requests.put((write, request))
        return request

    def stop(self) -> None:
        self.requests.put(None)
        self.thread.join(timeout=30)


def _nice() -> None:
    """The calling thread at gradsync's writer priority (``WRITER_NICE``), as both writer
    variants run, so that they differ only in where the write runs."""
    tid = threading.get_native_id()
    os.setpriority(os.PRIO_PROCESS, tid, WRITER_NICE)


def _writer_process(conn: Any) -> None:
    """The writer process: receives the shared staging buffer once, then writes rank files
    from it on request (the directory, the file name, the tensors' places, the metadata)."""
    _nice()
    buffer = conn.recv().numpy()
    conn.send("ready")
    while True:
        request = conn.recv()
        if request is None:
            return
        directory, name, entries, metadata = request
        tensors = [
            TensorBytes(key, dtype, shape, buffer[start:stop])
            for key, dtype, shape, start, stop in entries
        ]
        digest = hashlib.sha256()
        path = os.path.join(directory, name)
        write_atomic(path, tensor_file(tensors, metadata), digest=digest, direct=True)
        conn.send(digest.hexdigest())


class _Pending:
    """A request to the writer process, done when its answer has come."""

    def __init__(self, conn: Any) -> None:
        self.conn = conn
        self.answered = False

    def done(self) -> bool:
        if not self.answered and self.conn.poll():
            self.conn.recv()
            self.answered = True
        return self.answered

    def wait(self) -> None:
        if not self.answered:
            self.conn.recv()
            self.answered = True


def _ended(handle: Any, seen: float) -> float:
    """When ``handle``'s save ended, on ``time.perf_counter``'s clock: a gradsync handle's own
    end (``SaveHandle.ended``), else ``seen`` (when the training first saw it done)."""
    at = getattr(handle, "ended", None)
    if at is None:
        return seen
    return time.perf_counter() - (time.monotonic() - at)


class Savers:
    """Every variant's save of the same state, on this rank."""

    def __init__(self, args: argparse.Namespace, module: Any, opt: Any, rank: int) -> None:
        self.args, self.module, self.opt, self.rank = args, module, opt, rank
        self.world_size = dist.get_world_size()
        self.dirs = {name: os.path.join(args.dir, f"v{i}") for i, name in enumerate(VARIANTS)}
        self.names = opt.param_names(module)
        self.owners = model_owners(opt.plan(self.names), self.names)
        # DCP's async saves agree in a thread of their own: on the training's group their
        # collectives would meet training's (gloo: "collective mismatch"), so, as torchtitan
        # does, they get a gloo group of their own.
        self.dcp_group = dist.new_group(backend="gloo")
        self.thread_staging = StagingBuffer()
        self.shared: torch.Tensor | None = None
        self.writer: Any = None
        self.conn: Any = None
        self.thread_writer = _WriterThread()

    def rank_tensors(self) -> dict[str, torch.Tensor]:
        """What this rank's gradsync file holds: the weights it stores, its Adam state."""
        params = dict(self.module.named_parameters())
        out = {f"__model__/{n}": params[n] for n in self.names if self.owners[n] == self.rank}
        for i, state in enumerate(self.opt.optim.state.values()):  # the pieces it owns
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0:
                    out[f"piece{i}/{key}"] = value
        return out

    def dcp_state(self) -> dict[str, Any]:
        """The same tensors for DCP: the weights (replicated; DCP writes each once) and this
        rank's Adam state under keys of its own."""
        mine = {k: v for k, v in self.rank_tensors().items() if not k.startswith("__model__/")}
        return {"model": self.module.state_dict(), f"optim_rank{self.rank}": mine}

    def start_writer(self) -> None:
        """Start the writer process (once; as DCP's process mode, not timed)."""
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.writer = ctx.Process(target=_writer_process, args=(child,), daemon=True)
        self.writer.start()
        child.close()
        needed = sum(t.numel() * t.element_size() for t in self.rank_tensors().values())
        self.shared = torch.empty(needed + 4096, dtype=torch.uint8).share_memory_()
        self.conn.send(self.shared)
        assert self.conn.recv() == "ready"

    def stop_writer(self) -> None:
        self.thread_writer.stop()
        if self.writer is not None:
            self.conn.send(None)
            self.writer.join(timeout=30)

    def _file(self, name: str) -> tuple[str, str, dict[str, str]]:
        directory = os.path.join(self.dirs[name], f"rank{self.rank}")
        os.makedirs(directory, exist_ok=True)
        meta = {"rank": str(self.rank), "world_size": str(self.world_size)}
        return directory, rank_file(self.rank, self.world_size), meta

    def start(self, name: str) -> Any:
        """Start ``name``'s save; returns when it stops blocking training, with its handle."""
        path = self.dirs[name]
        if name == SYNC:
            self.opt.save(path, model=self.module)
            return _Ended()
        if name in (ASYNC, UNPACED):
            set_writer_share(self.args.writer_share if name == ASYNC else 1.0)
            return self.opt.save(path, model=self.module, blocking=False)
        if name == DCP_SYNC:
            dcp.save(self.dcp_state(), checkpoint_id=path)
            return _Ended()
        if name in (DCP_THREAD, DCP_PROCESS):
            kind = (
                AsyncCheckpointerType.THREAD
                if name == DCP_THREAD
                else AsyncCheckpointerType.PROCESS
            )
            future = dcp.async_save(
                self.dcp_state(),
                checkpoint_id=path,
                process_group=self.dcp_group,
                async_checkpointer_type=kind,
            )
            return _Future(future)
        directory, file_name, meta = self._file(name)
        if name == WRITER_THREAD:
            staged = self.thread_staging.stage(self.rank_tensors())
            chunks = tensor_file(tensor_bytes(staged), meta)
            return self.thread_writer.submit(lambda: write_rank_file(directory, file_name, chunks))
        assert self.shared is not None
        entries, offset = [], 0
        with torch.no_grad():
            for key, tensor in self.rank_tensors().items():
                nbytes = tensor.numel() * tensor.element_size()
                view = self.shared[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
                view.copy_(tensor)
                (described,) = tensor_bytes({key: view})
                entries.append((key, described.dtype, described.shape, offset, offset + nbytes))
                offset += -(-nbytes // 8) * 8
        self.conn.send((directory, file_name, entries, meta))
        return _Pending(self.conn)

    def clean(self) -> None:
        shutil.rmtree(self.args.dir, ignore_errors=True)


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    savers = None
    try:
        module = build_model(args)
        model = DataParallel(module)
        opt = ZeroRedundancyOptimizer(module.named_parameters(), torch.optim.Adam, lr=1e-4)
        inputs, targets = make_batch(args, rank, torch.device("cpu"))

        def step() -> float:
            start = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss_of(model, inputs, targets).backward()
            opt.step()
            return time.perf_counter() - start

        step()  # the Adam state exists from here
        savers = Savers(args, module, opt, rank)
        savers.start_writer()
        staged_bytes = sum(t.numel() * t.element_size() for t in savers.rank_tensors().values())
        # Per variant and timed round: [blocked, quiet steps..., steps after the save...,
        # in-flight flags of those steps...]; all-reduced with MAX at the end.
        rows: dict[str, list[list[float]]] = {name: [] for name in VARIANTS}
        for r in range(args.warmup + args.rounds):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for name in order:
                quiet = [step() for _ in range(args.quiet_steps)]
                dist.barrier()
                start = time.perf_counter()
                handle = savers.start(name)
                blocked = time.perf_counter() - start
                during, flags = [], []
                ended = None if not handle.done() else time.perf_counter()
                for _ in range(args.during_steps):
                    flags.append(0.0 if handle.done() else 1.0)
                    during.append(step())
                    if ended is None and handle.done():
                        ended = time.perf_counter()
                waiting = time.perf_counter()
                handle.wait()
                done_at = time.perf_counter()
                waited = done_at - waiting
                ended = _ended(handle, ended if ended is not None else done_at)
                dist.barrier()
                if r >= args.warmup:
                    rows[name].append([blocked, *quiet, *during, *flags, waited, ended - start])
        table = torch.tensor([rows[name] for name in VARIANTS], dtype=torch.float64)
        dist.all_reduce(table, op=dist.ReduceOp.MAX)
        staged = torch.tensor([staged_bytes], dtype=torch.float64)
        dist.all_reduce(staged)
        if rank == 0:
            out.put(
                _summary(
                    table.tolist(), args, int(staged.item()), count_params(module), staged_bytes
                )
            )
    finally:
        if savers is not None:
            savers.stop_writer()
        dist.barrier()
        if rank == 0 and savers is not None:
            savers.clean()
        dist.destroy_process_group()


def _summary(
    table: list[list[list[float]]],
    args: argparse.Namespace,
    total_bytes: int,
    params: int,
    rank0_bytes: int,
) -> dict[str, Any]:
    """Medians per variant: blocked time, quiet step, steps run while the save was in flight."""
    q, d = args.quiet_steps, args.during_steps
    quiet_all = [s for rows in table for row in rows for s in row[1 : 1 + q]]
    quiet = statistics.median(quiet_all)
    out: dict[str, Any] = {
        "params": params,
        "state_bytes": total_bytes,
        "rank0_bytes": rank0_bytes,
        "quiet_step_s": quiet,
        "variants": {},
    }
    for name, rows in zip(VARIANTS, table, strict=True):
        in_flight = [
            s
            for row in rows
            for s, flag in zip(row[1 + q : 1 + q + d], row[1 + q + d : 1 + q + 2 * d], strict=True)
            if flag
        ]
        totals = [row[0] + sum(row[1 + q : 1 + q + d]) + row[1 + q + 2 * d] for row in rows]
        out["variants"][name] = {
            "blocked_s": statistics.median(row[0] for row in rows),
            "steps_in_flight": len(in_flight),
            "step_in_flight_s": statistics.median(in_flight) if in_flight else None,
            "slowdown": statistics.median(in_flight) / quiet if in_flight else 1.0,
            "total_slowdown": statistics.median(totals) / (d * quiet),
            "wait_s": statistics.median(row[1 + q + 2 * d] for row in rows),
            "save_s": statistics.median(row[-1] for row in rows),
        }
    return out
