"""Where a ZeRO-3 step of ``cost_model.py``'s model spends its time, against the walk (issue 38).

Gloo ranks (one thread each, as the benchmark's), the benchmark's model (``--layers`` blocks of
``gelu(Linear(width, width))``, 64 rows over the ranks, Adam). The machine profile is
``gradsync calibrate``'s (``calibrate_local``), the model profile ``profile_model``'s on the
ranks. For ``fully_shard`` with and without ``reshard_after_forward`` it prints, on rank 0,
each phase's median (forward, backward, optimizer step, step) measured and as the walk
(``predict``) has it, and the measured time of ``fully_shard``'s own moves per step (timed by
wrapping ``UnitParameters``' methods): the all-gather's issue (``start_gather``: the
``torch.cat`` copy-in, the receive buffer, the issue), its wait, its copy-out (the rest of
``gather``: the fresh gathered storage, the copy), ``free``, the reduce-scatter's copy-in and
issue (``reduce_gradients``), its wait and the gradients' views (``finish_reduce``), each
phase's minor page faults (first touches of fresh pages), and the walk's timeline (each
collective's start, end and exposed time); and the walk again with compute beside the
all-gathers and reduce-scatters slowed 1000 times (``no overlap``: none of them hidden).
``--pairs``: a 1 MiB all-gather and reduce-scatter each issued, then about 0.5, 1, 2 and 4
times its length of compute (the block's forward, or with ``--mm`` calibrate's
matrix-multiply loop), as ``overlap_slowdowns`` pairs them, with the slowdown each pair gives
(from medians).

    python benchmarks/_cost_zero3_probe.py [--world 2] [--layers 8] [--width 512] [--pairs]
"""

from __future__ import annotations

import argparse
import functools
import os
import resource
import statistics
import sys
import time
from collections import defaultdict
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _cost_torch as ct
from _spawn import spawn_ranks

from gradsync_core.plan import Configuration, MachineProfile, predict
from gradsync_torch import fully_shard, param_specs
from gradsync_torch.cost.machine import calibrate_local
from gradsync_torch.param_sharding import _unit

MARKS: list[tuple[str, float, float]] = []
ON = [False]
MOVES = ("start_gather", "_wait", "gather", "free", "reduce_gradients", "finish_reduce")


def _wrap(name: str) -> None:
    f = getattr(_unit.UnitParameters, name)

    @functools.wraps(f)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not ON[0]:
            return f(*args, **kwargs)
        start = time.perf_counter()
        try:
            return f(*args, **kwargs)
        finally:
            MARKS.append((name, start, time.perf_counter()))

    setattr(_unit.UnitParameters, name, timed)


def _exclusive(marks: list[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds per move, a nested move's time taken out of the one around it."""
    out: dict[str, float] = defaultdict(float)
    for name, a, b in marks:
        inner = sum(
            d - c for n, c, d in marks if (c, d) != (a, b) and a <= c and d <= b and n != name
        )
        out[name] += b - a - inner
    return out


def _pairs(args: argparse.Namespace) -> list[str]:
    """A 1 MiB collective issued, then compute of about ``r`` times its length (the
    benchmark's block forward, repeated), as calibrate's ``overlap_slowdowns`` pairs them."""
    from gradsync_torch.cost import machine as mc

    world = dist.get_world_size()
    lin = torch.nn.Linear(args.width, args.width)
    x = torch.randn(args.global_batch // world, args.width)

    mm = torch.randn(256, 256)

    def work(count: int) -> float:
        start = time.perf_counter()
        with torch.no_grad():
            for _ in range(count):
                if args.mm:
                    mm.mm(mm)
                else:
                    torch.nn.functional.gelu(lin(x))
        return time.perf_counter() - start

    work(4)
    one = mc._slowest(statistics.median(work(8) / 8 for _ in range(5)))
    lines = [f"one block forward {one * 1e3:.3f} ms"]
    group = dist.group.WORLD
    for kind in ("all_gather", "reduce_scatter"):
        mc._run(kind, group, world, 1 << 20, torch.device("cpu"))
        alone = []
        for _ in range(7):
            dist.barrier()
            alone.append(mc._run(kind, group, world, 1 << 20, torch.device("cpu"))[1])
        a = mc._slowest(statistics.median(alone))
        for ratio in (0.5, 1.0, 2.0, 4.0):
            count = max(1, round(ratio * a / one))
            comp, both = [], []
            for _ in range(7):
                dist.barrier()
                comp.append(work(count))
                dist.barrier()
                start = time.perf_counter()
                handle = mc._issue(kind, group, world, (1 << 18) // world * world, x.device)
                work(count)
                handle.wait()
                both.append(time.perf_counter() - start)
            c = mc._slowest(statistics.median(comp))
            f = mc._slowest(statistics.median(both))
            lines.append(
                f"{kind} A {a * 1e3:.3f} C {c * 1e3:.3f} together {f * 1e3:.3f} ms: "
                f"slowdown {mc.slowdown_of_pair(a, c, f):.2f}, (F - C) / A {(f - c) / a:.2f}"
            )
    return lines


def worker(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank, world_size=world)
    for name in MOVES:
        _wrap(name)
    machine = MachineProfile.from_json(args.machine)
    rows = args.global_batch // world
    profiler = ct.Profiler(args, [Configuration(zero=3)], world)
    for _ in range(4):
        profiler.round()
    model = profiler.final()[rows]
    specs = param_specs(ct.build_net(args))
    report = []
    for reshard in (True, False):
        config = Configuration(zero=3, reshard_after_forward=reshard)
        p = predict(specs, config, world_size=world, machine=machine, model=model, global_batch=64)
        comms = {c.what: c for c in p.cost.comms}
        fwd_end = comms["agreement before the backward"].start_s
        bwd_end = comms["agreement before the optimizer step"].end_s
        net = ct.build_net(args)
        for layer in net.layers:
            fully_shard(layer, reshard_after_forward=reshard)
        fully_shard(net, reshard_after_forward=reshard)
        opt = ct.adam(net.parameters())
        x = ct.batch(args, rows, 1 + rank)
        phases, moves = [], []
        for i in range(args.steps + 3):
            dist.barrier()
            MARKS.clear()
            ON[0] = i >= 3
            f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            t0 = time.perf_counter()
            opt.zero_grad(set_to_none=True)
            loss = ct.square_loss(net(x))
            t1 = time.perf_counter()
            f1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            loss.backward()
            t2 = time.perf_counter()
            f2 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            opt.step()
            t3 = time.perf_counter()
            f3 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            ON[0] = False
            if i >= 3:
                phases.append((t1 - t0, t2 - t1, t3 - t2, t3 - t0, f1 - f0, f2 - f1, f3 - f2))
                fwd = [m for m in MARKS if m[2] <= t1]
                moves.append({"F" + k: v for k, v in _exclusive(fwd).items()})
                moves[-1].update(_exclusive([m for m in MARKS if m[1] >= t1]))
        med = [statistics.median(ph[k] for ph in phases) * 1e3 for k in range(4)]
        faults = [statistics.median(ph[k] for ph in phases) for k in range(4, 7)]
        names = [f + n for f in ("F", "") for n in MOVES]
        moved = {n: statistics.median(m.get(n, 0.0) for m in moves) * 1e3 for n in names}
        pred = [fwd_end * 1e3, (bwd_end - fwd_end) * 1e3, (p.step_s - bwd_end) * 1e3]
        pred.append(p.step_s * 1e3)
        serial = replace(
            machine,
            overlap_slowdowns={
                **machine.overlap_slowdowns,
                "all_gather": 1e3,
                "reduce_scatter": 1e3,
            },
        )
        q = predict(specs, config, world_size=world, machine=serial, model=model, global_batch=64)
        qc = {c.what: c for c in q.cost.comms}
        qf = qc["agreement before the backward"].start_s
        qb = qc["agreement before the optimizer step"].end_s
        pred += [qf * 1e3, (qb - qf) * 1e3, (q.step_s - qb) * 1e3, q.step_s * 1e3]
        report.append((reshard, med, moved, pred, p, faults))
    pairs = _pairs(args) if args.pairs else []
    fresh, warm = [], []
    kept = torch.empty(1 << 18)
    for _ in range(20):
        start = time.perf_counter()
        torch.empty(1 << 18).fill_(1.0)
        fresh.append(time.perf_counter() - start)
        start = time.perf_counter()
        kept.fill_(1.0)
        warm.append(time.perf_counter() - start)
    if rank == 0:
        print(
            f"1 MiB filled: fresh {statistics.median(fresh) * 1e3:.3f} ms, "
            f"reused {statistics.median(warm) * 1e3:.3f} ms"
        )
        for line in pairs:
            print(line)
        blocks = model.blocks
        print(
            f"x{world} layers {args.layers} width {args.width}: profile forward "
            f"{sum(b.forward_s for b in blocks) * 1e3:.2f} backward "
            f"{sum(b.backward_s for b in blocks) * 1e3:.2f} optimizer "
            f"{model.optimizer_s * 1e3:.2f} ms; copy {machine.copy_bandwidth / 1e9:.2f} GB/s; "
            f"host_s {dict((k, round(v * 1e3, 3)) for k, v in machine.host_s.items())}; "
            f"slowdowns {dict((k, round(v, 2)) for k, v in machine.overlap_slowdowns.items())}"
        )
        for reshard, med, moved, pred, p, faults in report:
            name = "reshard" if reshard else "keep"
            print(f"zero3 {name}: ms  forward backward optimizer step")
            print("  measured  " + " ".join(f"{v:8.2f}" for v in med))
            print("  walk      " + " ".join(f"{v:8.2f}" for v in pred[:4]))
            print("  no overlap" + " ".join(f"{v:8.2f}" for v in pred[4:]))
            print("  moves/step " + ", ".join(f"{k} {v:.2f}" for k, v in moved.items() if v))
            print(f"  page faults forward/backward/optimizer {faults}")
            for c in p.cost.comms:
                print(
                    f"    {c.what:40s} {c.start_s * 1e3:7.2f} {c.end_s * 1e3:7.2f} "
                    f"exposed {c.exposed_s * 1e3:5.2f}",
                    flush=True,
                )
        out.put(None)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--pairs", action="store_true", help="collective + compute pairs")
    parser.add_argument("--mm", action="store_true", help="pairs: compute calibrate's matmuls")
    args = parser.parse_args()
    args.global_batch, args.profile_steps = 64, 5
    args.machine = calibrate_local(args.world).to_json()
    args.world_size = args.world
    spawn_ranks(worker, args)


if __name__ == "__main__":
    main()
