"""The ``gradsync`` command line: show the plans for a model without running it."""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gradsync_core._buckets import (
    DEFAULT_CAP_BYTES,
    DEFAULT_FIRST_CAP_BYTES,
    MIB,
    BucketPlan,
    plan_buckets,
)
from gradsync_core._models import MODELS, builtin_model
from gradsync_core._shards import ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core._specs import DTYPE_ITEMSIZE, ParamSpec, check_unique_names, itemsize
from gradsync_core._topology import DEFAULT_ORDER, STANDARD_GROUPS, Topology

DEFAULT_MODEL = "gpt2-small"


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")


def _load_params(path: str) -> list[ParamSpec]:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read parameter file {path!r}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    entries = data.get("params") if isinstance(data, dict) else data
    if not isinstance(entries, list) or not entries:
        raise UsageError(
            f"{path!r} must hold a non-empty list of parameters, or an object with a 'params' "
            'list; each entry like {"name": "fc.weight", "shape": [10, 4], "dtype": "float32"}'
        )
    try:
        specs = [ParamSpec.from_json(entry) for entry in entries]
        check_unique_names(specs)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{path!r}: {e}") from None
    return specs


def _mib(nbytes: float) -> str:
    return f"{nbytes / MIB:,.2f}"


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]], max_rows: int = 40) -> str:
    shown: list[Sequence[Any]] = list(rows)
    if len(rows) > max_rows:
        half = max_rows // 2
        shown = [*rows[:half], ["..."] * len(headers), *rows[-half:]]
    cells = [[str(c) for c in row] for row in [headers, *shown]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _ranks(ranks: Sequence[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return "[" + ",".join(map(str, ranks)) + "]"
    return "[" + ",".join(map(str, ranks[: limit - 2])) + f",...,{ranks[-1]}]"


def _bucket_section(plan: BucketPlan) -> str:
    rows = []
    for b in plan.buckets:
        used = b.used_numel * itemsize(b.dtype)
        rows.append(
            [
                b.index,
                b.dtype,
                len(b.slots),
                f"{b.numel:,}",
                _mib(b.nbytes),
                _mib(b.limit_bytes),
                f"{100 * used / b.limit_bytes:.0f}%",
            ]
        )
    head = (
        f"Buckets: {len(plan.buckets)} (cap {_mib(plan.cap_bytes)} MiB, first walked "
        f"{_mib(plan.first_cap_bytes)} MiB; bucket 0 is reduced first)"
    )
    return (
        head
        + "\n"
        + _table(["bucket", "dtype", "params", "elements", "MiB", "cap MiB", "fill"], rows)
    )


def _shard_section(plan: ShardPlan, specs: Sequence[ParamSpec]) -> str:
    size = {s.name: itemsize(s.dtype) for s in specs}
    counts = [0] * plan.world_size
    nbytes = [0] * plan.world_size
    for shard in plan.shards:
        counts[shard.rank] += 1
        nbytes[shard.rank] += shard.numel * size[shard.name]
    rows = [
        [
            rank,
            counts[rank],
            f"{plan.rank_numel[rank]:,}",
            _mib(nbytes[rank]),
            _mib(2 * nbytes[rank]),
        ]
        for rank in range(plan.world_size)
    ]
    head = (
        f"Shard partition: {plan.kind} over {plan.world_size} data-parallel ranks, "
        f"imbalance {100 * plan.imbalance:.2f}% (max/mean - 1)"
    )
    if plan.kind == "flat":
        head += f", padding {plan.padding_numel:,} elements"
    return (
        head
        + "\n"
        + _table(
            ["dp rank", "pieces", "elements", "param MiB", "Adam state MiB"], rows, max_rows=16
        )
    )


def _group_section(topo: Topology) -> str:
    rows = []
    for name in STANDARD_GROUPS:
        groups = topo.groups(name)
        shown = " ".join(_ranks(g) for g in groups[:3]) + (" ..." if len(groups) > 3 else "")
        rows.append([name, len(groups[0]), len(groups), shown])
    head = (
        f"Rank groups: order {topo.order!r} (first varies fastest); mesh shape "
        f"{topo.mesh_shape} axes {topo.mesh_axis_names}"
    )
    return head + "\n" + _table(["group", "size", "count", "ranks"], rows, max_rows=20)


def _plan(args: argparse.Namespace) -> int:
    specs = _load_params(args.params) if args.params else builtin_model(args.model, args.dtype)
    topo = Topology.create(
        args.world_size, tp=args.tp, cp=args.cp, ep=args.ep, pp=args.pp, order=args.order
    )
    # DDP's convention: with no cap given, 25 MiB buckets and a 1 MiB first bucket.
    if args.bucket_cap_mb is None:
        cap, first = DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES
    else:
        if args.bucket_cap_mb <= 0:
            raise UsageError(f"--bucket-cap-mb must be positive, got {args.bucket_cap_mb}")
        cap = first = int(args.bucket_cap_mb * MIB)
    pad_to = math.lcm(args.pad_to, topo.dp) if args.partition == "flat" else args.pad_to
    buckets = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first, pad_to=pad_to)
    if args.partition == "flat":
        shards = plan_flat_shards(buckets, world_size=topo.dp)
    else:
        shards = plan_greedy_shards(specs, world_size=topo.dp)
    if args.json:
        out = {
            "buckets": buckets.to_json(),
            "shards": shards.to_json(),
            "topology": topo.to_json(),
            "fingerprints": {
                "buckets": buckets.fingerprint,
                "shards": shards.fingerprint,
                "topology": topo.fingerprint,
            },
        }
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    trainable = [s for s in specs if s.requires_grad]
    source = args.params or args.model
    print(
        f"Model {source}: {len(specs)} parameters ({len(trainable)} trainable), "
        f"{sum(s.numel for s in trainable):,} trainable elements, "
        f"{_mib(sum(s.nbytes for s in trainable))} MiB; world size {topo.world_size} = "
        f"tp {topo.tp} x cp {topo.cp} x ep {topo.ep} x dp {topo.dp} x pp {topo.pp}"
    )
    print()
    print(_bucket_section(buckets))
    print()
    print(_shard_section(shards, specs))
    print()
    print(_group_section(topo))
    print()
    print(
        f"fingerprints: buckets {buckets.fingerprint[:16]}  shards {shards.fingerprint[:16]}"
        f"  topology {topo.fingerprint[:16]}"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradsync", description="Show gradsync plans for a model.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan",
        help="bucket layout, shard partition and rank groups for a model",
        description="Print the bucket layout, optimizer-state partition and rank groups.",
    )
    source = plan.add_mutually_exclusive_group()
    source.add_argument(
        "--model", default=DEFAULT_MODEL, help=f"built-in model: {', '.join(MODELS)}"
    )
    source.add_argument(
        "--params",
        metavar="FILE",
        help='JSON list of parameters, e.g. [{"name": "fc.weight", "shape": [10, 4]}]',
    )
    plan.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_ITEMSIZE),
        help="dtype of a built-in model's parameters",
    )
    plan.add_argument("--world-size", type=int, default=8, help="number of ranks (default 8)")
    for axis in ("tp", "cp", "ep", "pp"):
        plan.add_argument(f"--{axis}", type=int, default=1, help=f"{axis} size (default 1)")
    plan.add_argument("--order", default=DEFAULT_ORDER, help="rank order, first varies fastest")
    plan.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="bucket cap in MiB (default: DDP's 25 MiB with a 1 MiB first bucket)",
    )
    plan.add_argument(
        "--partition",
        choices=("greedy", "flat"),
        default="greedy",
        help="optimizer-state partition: whole parameters or flat element ranges",
    )
    plan.add_argument(
        "--pad-to", type=int, default=1, help="round bucket lengths up to a multiple of this"
    )
    plan.add_argument("--json", action="store_true", help="emit the plans as JSON")
    plan.set_defaults(run=_plan)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradsync`` console script; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, ValueError, TypeError) as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gradsync plan | head`
        return 0
