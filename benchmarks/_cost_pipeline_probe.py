"""Where a 2-rank pipeline step of ``cost_model.py`` spends its time (issue 38, a probe).

The benchmark's ranks, model and configurations (``_cost_torch``: its ``Profiler`` and
``Runner``), ``pp 2`` with GPipe and 1F1B, built from ``predict``'s plans; each step recorded
by the executor's own ``Pipeline.timeline`` on one clock for both ranks (the steps'
``perf_counter``), beside ``zero_grad`` and the optimizer step, and each message's trip (its
send's post ended on one rank, the compute that waited for it began on the other). Printed on
rank 0, per schedule: each rank's actions in the median step (ms from the step's start),
measured and simulated (``pipeline_simulation``: what ``predict_pipeline`` costs), then the
medians over the steps.

    python benchmarks/_cost_pipeline_probe.py [--layers 8 --width 512 --microbatches 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _cost_torch import Calibrator, Profiler, Runner, build_net, microbatch_size
from _spawn import spawn_ranks

from gradsync_core.plan import Configuration, MachineProfile, predict
from gradsync_core.plan.cost._pipeline_cost import pipeline_simulation
from gradsync_torch import param_specs
from gradsync_torch.cost.machine import calibrate_local

SCHEDULES = ("GPipe", "1F1B")


def _record(runner: Runner, timeline: bool = True) -> dict[str, Any]:
    """One step of ``runner``, every part on the shared clock (the actions: ``timeline``)."""
    pipe = runner.pipe
    pipe.timeline = [] if timeline else None
    t0 = time.perf_counter()
    runner.opt.zero_grad(set_to_none=True)
    t1 = time.perf_counter()
    pipe.step(*((runner.x,) if runner.first else ()), target=runner.x)
    t2 = time.perf_counter()
    runner.opt.step()
    t3 = time.perf_counter()
    began = pipe._step_began
    actions = [(str(t.action), began + t.start, began + t.end) for t in pipe.timeline or ()]
    pipe.timeline = None
    return {"t0": t0, "zero_grad": t1, "began": began, "pipe": t2, "opt": t3, "actions": actions}


def worker(rank: int, world: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world
    )
    try:
        machine = MachineProfile.from_json(args.machine)
        specs = param_specs(build_net(args))
        configs = [
            Configuration(pp=2, schedule=s, microbatches=args.microbatches) for s in SCHEDULES
        ]
        profiler = Profiler(args, configs, world)
        size = microbatch_size(args, world, configs[0])
        model = profiler.first[size]
        preds = [
            predict(
                specs,
                c,
                world_size=world,
                machine=machine,
                model=model,
                global_batch=args.global_batch,
            )
            for c in configs
        ]
        runners = [Runner(args, p, rank) for p in preds]
        for runner in runners:
            for _ in range(args.warmup):
                runner.step()
        records: list[list[dict[str, Any]]] = [[] for _ in runners]
        plain: list[list[dict[str, Any]]] = [[] for _ in runners]
        calibrator = Calibrator(world) if args.between else None
        for r in range(args.steps):
            if calibrator is not None:  # what cost_model.py runs between its rounds of steps
                dist.barrier()
                calibrator.round()
                dist.barrier()
                profiler.round()
                dist.barrier()
                profiler.plain_step(max(profiler.nets))
            for i in (0, 1) if r % 2 == 0 else (1, 0):
                dist.barrier()
                records[i].append(_record(runners[i], not args.no_timeline))
                if args.ab:  # the same step without the timeline, right after
                    dist.barrier()
                    plain[i].append(_record(runners[i], False))
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, records)
        untimed: list[Any] = [None] * world
        dist.all_gather_object(untimed, plain)
        if rank == 0:
            out.put(
                {
                    "records": everyone,
                    "plain": untimed,
                    "predicted": [p.step_s for p in preds],
                    "simulated": [
                        [
                            [(str(t.action), t.start, t.end) for t in timed]
                            for timed in pipeline_simulation(
                                p.pipeline, specs, machine=machine, model=model, samples=size
                            ).actions
                        ]
                        for p in preds
                    ],
                    "model": model.to_json(),
                    "post_s": dict(machine.post_s),
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _ms(x: float) -> str:
    return f"{x * 1e3:6.2f}"


def summarize(result: dict[str, Any], world: int) -> None:
    records = result["records"]  # [rank][schedule][step]
    print("post_s", {k: round(v * 1e3, 3) for k, v in result["post_s"].items()})
    blocks = result["model"]["blocks"]
    print(
        "profile: forward",
        _ms(sum(b["forward_s"] for b in blocks)),
        "backward",
        _ms(sum(b["backward_s"] for b in blocks)),
        "optimizer",
        _ms(result["model"]["optimizer_s"]),
    )
    for i, schedule in enumerate(SCHEDULES):
        steps = len(records[0][i])
        per_step = []
        for k in range(steps):
            zero = min(records[r][i][k]["t0"] for r in range(world))
            end = max(records[r][i][k]["opt"] for r in range(world))
            per_step.append((end - zero, k, zero))
        per_step.sort()
        total, median_k, _ = per_step[len(per_step) // 2]
        print(
            f"\n== {schedule}: predicted {_ms(result['predicted'][i])} ms, measured median "
            f"{_ms(total)} ms (step {median_k}; all: "
            f"{', '.join(_ms(t).strip() for t, _, _ in sorted(per_step, key=lambda x: x[1]))})"
        )
        own = [
            max(records[r][i][k]["opt"] - records[r][i][k]["t0"] for r in range(world))
            for k in range(steps)
        ]
        print(
            "   as cost_model.py times it (the slowest rank's own step): median",
            _ms(statistics.median(own)),
        )
        if result["plain"][0][i]:
            untimed = result["plain"]
            own = [
                max(untimed[r][i][k]["opt"] - untimed[r][i][k]["t0"] for r in range(world))
                for k in range(len(untimed[0][i]))
            ]
            print(
                "   the same, each step's twin without the timeline:", _ms(statistics.median(own))
            )
        if not records[0][i][0]["actions"]:
            continue
        # medians over the steps, each action relative to its step's common zero
        for r in range(world):
            rows: dict[str, list[tuple[float, float]]] = {}
            phases: dict[str, list[float]] = {}
            for k in range(steps):
                zero = min(records[q][i][k]["t0"] for q in range(world))
                rec = records[r][i][k]
                for name, start, end in rec["actions"]:
                    rows.setdefault(name, []).append((start - zero, end - zero))
                for phase in ("zero_grad", "began", "pipe", "opt"):
                    phases.setdefault(phase, []).append(rec[phase] - zero)
                last = max(e for _, _, e in rec["actions"])
                phases.setdefault("finish(after last action)", []).append(rec["pipe"] - last)
            sim = {name: (s, e) for name, s, e in result["simulated"][i][r]}
            print(f"-- rank {r}: median over {steps} steps (ms from the step's start)")
            for name, spans in rows.items():
                start = statistics.median(s for s, _ in spans)
                took = statistics.median(e - s for s, e in spans)
                s_sim = sim.get(name)
                simtxt = (
                    "" if s_sim is None else f"   sim {_ms(s_sim[0])} +{_ms(s_sim[1] - s_sim[0])}"
                )
                print(f"   {name:<14} at {_ms(start)} took {_ms(took)}{simtxt}")
            print(
                "   phases:",
                ", ".join(f"{k} {_ms(statistics.median(v)).strip()}" for k, v in phases.items()),
            )
        # each message: its send's post end on one rank, the receiver's wait (from its
        # previous action's end) and the compute that consumed it
        late: dict[str, list[float]] = {}
        for k in range(steps):
            ends = {}
            for r in range(world):
                for name, _, end in records[r][i][k]["actions"]:
                    if "SEND" in name:
                        ends[name] = end
            for r in range(world):
                previous = None
                for name, start, end in records[r][i][k]["actions"]:
                    key = _sender(name)
                    if key in ends and previous is not None:
                        waited = max(ends[key], previous)
                        what = "slept" if ends[key] > previous else "ready"
                        late.setdefault(what, []).append(start - waited)
                        late.setdefault(f"{what} {key}", []).append(start - waited)
                    if "RECV" not in name:
                        previous = end
        print("   message in -> compute start (ms; slept: the receiver waited before the send):")
        for key in sorted(late):
            v = late[key]
            print(f"     {key:<16} n={len(v):3d} median {_ms(statistics.median(v))}")


def _sender(name: str) -> str:
    """The send whose message the compute ``name`` consumes (two stages), or ''."""
    stage, rest = int(name[0]), name[1:]
    if rest[0] == "F" and stage > 0:
        return f"{stage - 1}SEND_F{rest[1:]}"
    if rest[0] == "B" and stage < 1:
        return f"{stage + 1}SEND_B{rest[1:]}"
    return ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--profile-steps", type=int, default=5)
    parser.add_argument(
        "--between",
        action="store_true",
        help="run cost_model.py's calibration and profile rounds between the rounds of steps",
    )
    parser.add_argument(
        "--no-timeline", action="store_true", help="steps without the executor's timeline"
    )
    parser.add_argument(
        "--ab", action="store_true", help="each step twice: with the timeline, then without"
    )
    parser.add_argument("--save", default=None, help="write the records here (JSON)")
    args = parser.parse_args()
    args.world_size = 2
    args.machine = calibrate_local(2).to_json()
    result = spawn_ranks(worker, args)
    if args.save:
        with open(args.save, "w") as f:
            json.dump(result, f)
    summarize(result, 2)


if __name__ == "__main__":
    main()
