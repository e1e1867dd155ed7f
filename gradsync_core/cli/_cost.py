"""``gradsync plan --cost machine.json --model-profile model.json``: a plan's predicted step.

The configuration comes from ``gradsync plan``'s own flags (``--zero``, ``--bucket-cap-mb``,
``--dp-shard``, ``--pp --schedule --microbatches``, ``--world-size``) and three of its own
(``--no-overlap``, ``--keep-after-forward``, ``--global-batch``); ``predict`` plans it as the
executors do and costs exactly those plans. ``--search --memory-per-rank 80GiB`` costs every
configuration instead and prints the fastest that fit, and why the others were dropped. Without
a model profile, ``--tokens`` gives a FLOP-based estimate at the machine profile's
``flops_per_s`` (marked as an estimate). Text by default, ``--json`` for machines
(docs/cost-model.md).
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Sequence

from gradsync_core.cli._json import report_header
from gradsync_core.cli._table import mib, table
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan.cost._machine import MachineProfile
from gradsync_core.plan.cost._model_profile import ModelProfile, estimate_model_profile
from gradsync_core.plan.cost._predict import Configuration, Prediction, predict
from gradsync_core.plan.cost._search import SearchResult, search_configurations

_UNITS = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_UNITS |= {"kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_SHOWN_COMMS = 40
_SHOWN_DROPPED = 40


def add_cost_arguments(plan: argparse.ArgumentParser) -> None:
    """The cost-model options of ``gradsync plan``."""
    plan.add_argument(
        "--cost",
        default=None,
        metavar="MACHINE.json",
        help="predict the step of this plan on the machine profile (gradsync calibrate's "
        "output or a hand-written one): step time, exposed communication, memory per rank",
    )
    plan.add_argument(
        "--model-profile",
        default=None,
        metavar="MODEL.json",
        help="--cost: each block's forward and backward time (gradsync_torch/gradsync_jax "
        "profile_model, or written by hand)",
    )
    plan.add_argument(
        "--tokens",
        type=int,
        default=None,
        help="--cost without --model-profile: tokens per rank and step, for a FLOP-based "
        "estimate at the machine profile's flops_per_s (marked as an estimate)",
    )
    plan.add_argument(
        "--global-batch",
        type=int,
        default=None,
        help="--cost: samples per step over all ranks (default: the model profile's on every "
        "data-parallel rank and microbatch)",
    )
    plan.add_argument(
        "--no-overlap",
        action="store_true",
        help="--cost: reduce after the backward instead of during it",
    )
    plan.add_argument(
        "--keep-after-forward",
        action="store_true",
        help="--cost with --zero 3: reshard_after_forward=False (keep gathered units)",
    )
    plan.add_argument(
        "--search",
        action="store_true",
        help="--cost: cost every configuration (ZeRO stage, bucket cap, reshard_after_forward, "
        "HSDP shard size, pipeline split, schedule, microbatches) and print the fastest that fit",
    )
    plan.add_argument(
        "--memory-per-rank",
        default=None,
        metavar="SIZE",
        help="--search: what a rank may hold, e.g. 80GiB, 40GB, 512MiB",
    )
    plan.add_argument("--top", type=int, default=5, help="--search: how many to print")


def cost_requested(args: argparse.Namespace) -> bool:
    """Whether ``--cost`` (or one of the options that only apply with it) was given."""
    return args.cost is not None or args.search or args.model_profile is not None


def parse_bytes(value: str) -> int:
    """``"80GiB"`` -> 85899345920; ``"40GB"``, ``"512MiB"``, ``"1000"`` (bytes).

    Raises:
        ValueError: not a positive size with a known unit.
    """
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS or float(m.group(1)) <= 0:
        raise ValueError(
            f"--memory-per-rank takes a positive size such as 80GiB, 40GB or 512MiB, got {value!r}"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _configuration(args: argparse.Namespace) -> Configuration:
    return Configuration(
        zero=args.zero or 0,
        bucket_cap_mb=args.bucket_cap_mb,
        overlap=not args.no_overlap,
        reshard_after_forward=not args.keep_after_forward,
        dp_shard=args.dp_shard,
        pp=args.pp,
        schedule=args.schedule,
        microbatches=args.microbatches or 1,
    )


def _check(args: argparse.Namespace) -> None:
    if args.cost is None:
        raise ValueError(
            "--search and --model-profile cost a plan on a machine: give --cost MACHINE.json "
            "(gradsync calibrate writes one)"
        )
    if (args.tp, args.cp, args.ep) != (1, 1, 1):
        raise ValueError(
            "the cost model plans data and pipeline parallelism only; drop --tp, --cp and --ep "
            "(give one rank's shapes with --params to cost a fixed tensor-parallel split)"
        )
    if args.memory_per_rank is not None and not args.search:
        raise ValueError("--memory-per-rank applies to --search")
    if args.keep_after_forward and args.zero != 3 and not args.search:
        raise ValueError("--keep-after-forward applies to --zero 3 (reshard_after_forward)")
    if not 1 <= args.top <= 1000:
        raise ValueError(f"--top must be between 1 and 1000, got {args.top}")


def _model(
    args: argparse.Namespace, specs: Sequence[ParamSpec], machine: MachineProfile
) -> ModelProfile:
    if args.model_profile is not None:
        if args.tokens is not None:
            raise ValueError("--tokens is for a FLOP estimate without --model-profile; pass one")
        return ModelProfile.load(args.model_profile)
    if args.tokens is None or args.tokens < 1:
        raise ValueError(
            "--cost needs --model-profile MODEL.json (profile_model measures one), or --tokens N "
            "for a FLOP-based estimate"
        )
    if machine.flops_per_s is None:
        raise ValueError(
            f"machine profile {machine.name!r} has no flops_per_s for a FLOP-based estimate; add "
            'one ("flops_per_s": 4e14 for an H100 at 40% of its bf16 peak) or pass --model-profile'
        )
    return estimate_model_profile(specs, tokens=args.tokens, flops_per_s=machine.flops_per_s)


def cost_command(args: argparse.Namespace, specs: list[ParamSpec], tied: Sequence[str]) -> int:
    """``--cost`` and ``--search``: print the prediction or the search (or their JSON)."""
    _check(args)
    machine = MachineProfile.load(args.cost)
    model = _model(args, specs, machine)
    source = args.params or args.model
    if args.search:
        limit = None if args.memory_per_rank is None else parse_bytes(args.memory_per_rank)
        result = search_configurations(
            specs,
            world_size=args.world_size,
            machine=machine,
            model=model,
            memory_per_rank=limit,
            global_batch=args.global_batch,
            optimizer=_optimizer(args.optimizer),
            tied=tied,
            executor=args.executor,
        )
        if args.json:
            print(json.dumps(report_header() | {"search": result.to_json(args.top)}, indent=1))
            return 0
        print(search_text(result, source, machine, model, args.top))
        return 0
    prediction = predict(
        specs,
        _configuration(args),
        world_size=args.world_size,
        machine=machine,
        model=model,
        global_batch=args.global_batch,
        optimizer=_optimizer(args.optimizer),
        tied=tied,
        executor=args.executor,
    )
    if args.json:
        out = report_header() | {
            "prediction": prediction.to_json(),
            "machine": machine.fingerprint,
            "model_profile": model.fingerprint,
        }
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    print(prediction_text(prediction, source, machine, model))
    return 0


def _optimizer(value: str) -> str | int:
    return int(value) if value.isdigit() else value


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f}"


def prediction_text(
    p: Prediction, source: str, machine: MachineProfile, model: ModelProfile
) -> str:
    """The step, its collectives (the first and last when there are many) and each rank's
    memory."""
    c = p.cost
    head = (
        f"Cost of {p.configuration.describe()} for {source} on {p.topology.world_size} ranks "
        f"(dp {p.topology.dp}, pp {p.topology.pp}), {p.samples} samples per rank and "
        f"microbatch; machine {machine.name!r}, model profile {model.source}"
    )
    step = (
        f"step {_ms(c.step_s)} ms = compute {_ms(c.compute_s)} ms + exposed communication "
        f"{_ms(c.exposed_comm_s)} ms"
    )
    rows = [
        [
            e.what,
            e.collective,
            e.group,
            e.group_size,
            mib(e.nbytes),
            _ms(e.start_s),
            _ms(e.end_s),
            _ms(e.exposed_s),
        ]
        for e in c.comms
    ]
    comms = "Collectives (exposed: the part of it no compute hid), in issue order:\n" + table(
        ["what", "collective", "group", "ranks", "MiB", "start ms", "end ms", "exposed ms"],
        rows,
        max_rows=_SHOWN_COMMS,
    )
    memory_rows = [
        [
            r.rank,
            mib(r.memory.parameter_bytes),
            mib(r.memory.gradient_bytes),
            mib(r.memory.optimizer_state_bytes),
            mib(r.memory.transient_bytes),
            "?" if r.activation_bytes is None else mib(r.activation_bytes),
            "?" if r.optimizer_peak_bytes is None else mib(r.optimizer_peak_bytes),
            mib(r.peak_bytes),
        ]
        for r in c.ranks
    ]
    what = (
        "pp rank"
        if p.configuration.pp > 1
        else "shard rank"
        if p.configuration.zero == 3
        else "dp rank"
    )
    memory = (
        "Memory per rank (model states from the plan; activations at the backward's worst "
        "moment; the optimizer step with its scratch):\n"
        + table(
            [
                what,
                "params MiB",
                "grads MiB",
                "state MiB",
                "transient MiB",
                "activations MiB",
                "at step MiB",
                "peak MiB",
            ],
            memory_rows,
        )
    )
    fullest = max(c.ranks, key=lambda r: (r.peak_bytes, -r.rank))
    parts = [head, step]
    if c.notes:
        parts.append("notes: " + "; ".join(c.notes))
    prints = "  ".join(f"{k} {v[:16]}" for k, v in p.fingerprints.items())
    parts += [
        comms,
        memory,
        f"fullest: {what} {fullest.rank}, peak {mib(fullest.peak_bytes)} MiB",
        f"fingerprints: {prints}",
    ]
    return "\n\n".join(parts)


def search_text(
    result: SearchResult, source: str, machine: MachineProfile, model: ModelProfile, top: int
) -> str:
    """The fastest configurations that fit and every dropped one with its reason."""
    limit = "no limit" if result.memory_per_rank is None else f"{mib(result.memory_per_rank)} MiB"
    head = (
        f"Search for {source} on {result.world_size} ranks, global batch {result.global_batch}, "
        f"memory per rank {limit}; machine {machine.name!r}, model profile {model.source}: "
        f"{len(result.ranked)} fit, {len(result.dropped)} dropped"
    )
    rows = [
        [
            i + 1,
            p.configuration.describe(),
            p.topology.dp,
            _ms(p.step_s),
            _ms(p.cost.exposed_comm_s),
            mib(p.peak_bytes),
        ]
        for i, p in enumerate(result.ranked[:top])
    ]
    best = table(["#", "configuration", "dp", "step ms", "exposed ms", "peak MiB"], rows)
    dropped = [
        f"  {d.configuration.describe()}: {d.reason}" for d in result.dropped[:_SHOWN_DROPPED]
    ]
    if len(result.dropped) > _SHOWN_DROPPED:
        dropped.append(f"  ... and {len(result.dropped) - _SHOWN_DROPPED} more (--json lists all)")
    parts = [head, best if rows else "nothing fits"]
    if dropped:
        parts.append("Dropped:\n" + "\n".join(dropped))
    if result.ranked:
        prints = "  ".join(f"{k} {v[:16]}" for k, v in result.best.fingerprints.items())
        parts.append(f"best: {result.best.configuration.describe()}; fingerprints: {prints}")
    return "\n\n".join(parts)
