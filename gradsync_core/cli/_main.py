"""The ``gradsync`` command line: show the plans for a model without running it.

Every input is bounded, so a typo cannot make the planner allocate for minutes:

- ``--world-size`` and each of ``--tp/--cp/--ep/--pp``: an int from 1 to 1,048,576 (2**20);
  groups are computed by arithmetic, so the largest world plans in well under 2 s and 1 GiB,
  and the group table shows counts, sizes and the first groups, not every group.
- ``--bucket-cap-mb``: a finite number of MiB, above 0 and at most 65,536 (64 GiB).
- ``--pad-to``: an int from 1 to 1,048,576.
- ``--partition flat``: at most 131,072 (2**17) shard pieces, about buckets x dp ranks;
  beyond that, raise ``--bucket-cap-mb`` or use the greedy partition.
- ``--params``: a JSON file of at most 64 MiB, nested at most a few hundred levels, each entry
  a parameter of the right types (see ``ParamSpec.from_json``); the object form may name the
  tied weights (``"tied"``).
- ``--model MODULE:FUNCTION``: a live model, read by its framework's executor
  (``_model``).

- ``--dp-shard`` (``--shard-size``, its deprecated spelling): an int from 1 to 1,048,576
  that divides the data-parallel size (``_zero``).
- ``--zero``: at most 65,536 (2**16) data-parallel ranks, each listed in ``--json``.

``gradsync checkpoint inspect PATH`` checks and summarizes a checkpoint (``_checkpoint``);
``gradsync calibrate`` measures the machine profile and ``gradsync plan --cost`` costs a plan
with it (``_calibrate``, ``_cost``).

Bad input prints one line on stderr and exits with code 2 (the CLI is in docs/design.md §2).
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from gradsync_core import __version__
from gradsync_core.cli._calibrate import add_calibrate_parser
from gradsync_core.cli._checkpoint import add_checkpoint_parser
from gradsync_core.cli._cost import add_cost_arguments, cost_command, cost_requested
from gradsync_core.cli._json import plan_report, report_header
from gradsync_core.cli._model import is_live_model, live_model
from gradsync_core.cli._pipeline import add_pipeline_arguments, pipeline_command, pipeline_requested
from gradsync_core.cli._table import mib as _mib
from gradsync_core.cli._table import shown as _shown
from gradsync_core.cli._table import table as _table
from gradsync_core.cli._zero import (
    BUILTIN_TIED,
    add_zero_arguments,
    check_zero_arguments,
    composed_estimate,
    composed_json,
    composed_requested,
    composed_text,
    save_staging,
    tied_names,
    zero_estimate,
    zero_json,
    zero_text,
)
from gradsync_core.plan._buckets import (
    Bucket,
    BucketPlan,
    bucket_caps,
    plan_buckets,
    plan_param_buckets,
)
from gradsync_core.plan._llama import LLAMA_MODELS, LlamaShape
from gradsync_core.plan._models import MODELS, builtin_model
from gradsync_core.plan._rank_generator import HSDP_AXES
from gradsync_core.plan._reductions import split_expert_specs
from gradsync_core.plan._shards import ShardPlan, plan_flat_shards, plan_greedy_shards
from gradsync_core.plan._specs import DTYPE_ITEMSIZE, ParamSpec, check_unique_names, itemsize
from gradsync_core.plan._topology import DEFAULT_ORDER, EXPERT_GROUPS, STANDARD_GROUPS, Topology

DEFAULT_MODEL = "gpt2-small"
MAX_WORLD_SIZE = 1 << 20  # 1,048,576 ranks: beyond today's largest jobs, and plans in < 2 s
MAX_BUCKET_CAP_MB = 65536.0  # 64 GiB: larger than any device's memory
MAX_PAD_TO = MAX_WORLD_SIZE
MAX_PARAMS_FILE_BYTES = 64 << 20  # about a million parameter entries
# A flat partition lists a piece per (bucket, rank) it touches: buckets x dp of them.
MAX_FLAT_PIECES = 1 << 17
# Partition tables list at most this many data-parallel ranks (head and tail).
_SHOWN_RANKS = 16


class UsageError(Exception):
    """Bad input: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see '{self.prog} --help')")

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: Any = None
    ) -> argparse.Namespace:
        """argparse's, with an unknown flag named against the subcommand's own flags."""
        parsed: argparse.Namespace
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            raise UsageError(_unrecognized(self, parsed, extras))
        return parsed


def _chosen(parser: argparse.ArgumentParser, parsed: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)command parser the arguments went to, ``gradsync checkpoint inspect``'s too."""
    for action in parser._actions:  # argparse keeps subcommands on its subparsers action
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(parsed, action.dest, None)
            if chosen in action.choices:
                return _chosen(action.choices[chosen], parsed)
    return parser


def _unrecognized(
    parser: argparse.ArgumentParser, parsed: argparse.Namespace, extras: list[str]
) -> str:
    """``unrecognized argument '--wrold-size'; did you mean '--world-size'?`` and the help of
    the subcommand the flag was given to (argparse itself points at the top-level help)."""
    sub = _chosen(parser, parsed)
    known = [flag for action in sub._actions for flag in action.option_strings]
    flags = [arg for arg in extras if arg.startswith("-")]
    if not flags:
        return f"unexpected arguments {' '.join(extras)!r} (see '{sub.prog} --help')"
    message = f"unknown flag {flags[0]!r}"
    close = difflib.get_close_matches(flags[0].split("=", 1)[0], known, n=1, cutoff=0.6)
    if close:
        message += f"; did you mean {close[0]!r}?"
    if len(flags) > 1:
        message += f" (and {', '.join(map(repr, flags[1:]))})"
    return f"{message} (see '{sub.prog} --help')"


_PARAMS_FILE_KEYS = ("params", "tied")


def _load_params(path: str) -> tuple[list[ParamSpec], tuple[str, ...]]:
    """The parameters a ``--params`` file lists and the names of its tied weights."""
    try:
        with open(path, "rb") as f:
            # Read one byte past the cap to tell "at the cap" from "over it" without
            # reading a huge file whole.
            raw = f.read(MAX_PARAMS_FILE_BYTES + 1)
    except OSError as e:
        raise UsageError(f"cannot read parameter file {path!r}: {e.strerror}") from None
    if len(raw) > MAX_PARAMS_FILE_BYTES:
        raise UsageError(
            f"parameter file {path!r} is larger than {MAX_PARAMS_FILE_BYTES >> 20} MiB; "
            "list each parameter once with its name, shape and dtype only"
        )
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{path!r} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path!r} is not valid JSON: {e.msg} at line {e.lineno}") from None
    except RecursionError:
        raise UsageError(
            f"{path!r} is nested too deeply to be a parameter list; expect a list of objects"
        ) from None
    except ValueError as e:  # e.g. an integer literal with more digits than Python parses
        raise UsageError(f"{path!r} is not usable JSON: {e}") from None
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
    return specs, _tied(path, data, specs) if isinstance(data, dict) else ()


def _tied(path: str, data: dict[str, Any], specs: Sequence[ParamSpec]) -> tuple[str, ...]:
    """The file's ``"tied"`` list: parameters used under more than one name (a head tied to
    the embedding), each named as listed; refuses a key the file format does not have."""
    unknown = sorted(set(data) - set(_PARAMS_FILE_KEYS))
    if unknown:
        raise UsageError(
            f"{path!r} has the key {unknown[0]!r}; a parameter file object holds "
            f"{' and '.join(map(repr, _PARAMS_FILE_KEYS))} only"
        )
    tied = data.get("tied", [])
    if not isinstance(tied, list) or not all(isinstance(name, str) for name in tied):
        raise UsageError(
            f"{path!r}: 'tied' must be a list of parameter names, e.g. "
            f'["transformer.wte.weight"], got {json.dumps(tied)[:60]}'
        )
    names = {spec.name for spec in specs}
    for name in tied:
        if name not in names:
            raise UsageError(
                f"{path!r}: tied parameter {name!r} is not in 'params'; name a tied weight "
                "as it is listed there (once, under its first name)"
            )
    return tuple(dict.fromkeys(tied))


def _check_bounds(args: argparse.Namespace) -> None:
    """Refuse sizes beyond the documented maxima before anything is planned."""
    maxima = {name: MAX_WORLD_SIZE for name in ("world_size", "tp", "cp", "ep", "pp")}
    if args.etp is not None:
        maxima["etp"] = MAX_WORLD_SIZE
    for name in ("dp_shard", "shard_size", "dp_replicate"):
        if getattr(args, name) is not None:
            maxima[name] = MAX_WORLD_SIZE
    for name, maximum in (maxima | {"pad_to": MAX_PAD_TO}).items():
        value = getattr(args, name)
        if not 1 <= value <= maximum:
            raise UsageError(
                f"--{name.replace('_', '-')} must be between 1 and {maximum:,}, got {value:,}"
            )
    cap = args.bucket_cap_mb
    if cap is not None:
        if math.isnan(cap) or cap <= 0:
            raise UsageError(f"--bucket-cap-mb must be positive, got {cap}")
        if not cap <= MAX_BUCKET_CAP_MB:
            raise UsageError(
                f"--bucket-cap-mb must be at most {MAX_BUCKET_CAP_MB:,.0f} (64 GiB), got {cap}"
            )


def _ranks(ranks: Sequence[int], limit: int = 8) -> str:
    if len(ranks) <= limit:
        return "[" + ",".join(map(str, ranks)) + "]"
    return "[" + ",".join(map(str, ranks[: limit - 2])) + f",...,{ranks[-1]}]"


def _fill(bucket: Bucket) -> str:
    """How full a bucket is; one over its cap says why: DDP closes a bucket once it reaches the
    cap, so only its last tensor can carry it over (a tensor larger than the cap alone)."""
    used = bucket.used_numel * itemsize(bucket.dtype)
    if used <= bucket.limit_bytes:
        return f"{100 * used / bucket.limit_bytes:.0f}%"
    if len(bucket.slots) == 1:
        return "over cap: one tensor larger than the cap"
    return "over cap: last tensor pushed it over"


def _bucket_section(plan: BucketPlan) -> str:
    rows = [
        [
            b.index,
            b.dtype,
            len(b.slots),
            f"{b.numel:,}",
            _mib(b.nbytes),
            _mib(b.limit_bytes),
            _fill(b),
        ]
        for b in plan.buckets
    ]
    head = (
        f"Buckets: {len(plan.buckets)} (cap {_mib(plan.cap_bytes)} MiB, first walked "
        f"{_mib(plan.first_cap_bytes)} MiB; bucket 0 is reduced first)"
    )
    return (
        head
        + "\n"
        + _table(["bucket", "dtype", "tensors", "elements", "MiB", "cap MiB", "fill"], rows)
    )


def _shard_section(plan: ShardPlan, specs: Sequence[ParamSpec], axis: str = "dp") -> str:
    size = {s.name: itemsize(s.dtype) for s in specs}
    counts = [0] * plan.world_size
    nbytes = [0] * plan.world_size
    for shard in plan.shards:
        counts[shard.rank] += 1
        nbytes[shard.rank] += shard.numel * size[shard.name]
    rank_numel = plan.rank_numel  # a property that walks every shard: read it once
    rows: list[Sequence[Any]] = [
        [
            rank,
            counts[rank],
            f"{rank_numel[rank]:,}",
            _mib(nbytes[rank]),
            _mib(2 * nbytes[rank]),
        ]
        for rank in _shown(plan.world_size, _SHOWN_RANKS)
    ]
    if plan.world_size > _SHOWN_RANKS:
        rows.insert(_SHOWN_RANKS // 2, ["..."] * 5)
    what = "data-parallel" if axis == "dp" else "expert data-parallel (edp)"
    head = (
        f"Shard partition: {plan.kind} over {plan.world_size} {what} ranks, "
        f"imbalance {100 * plan.imbalance:.2f}% (max/mean - 1)"
    )
    if plan.kind == "flat":
        head += f", padding {plan.padding_numel:,} elements"
    return (
        head
        + "\n"
        + _table(
            [f"{axis} rank", "pieces", "elements", "param MiB", "Adam state MiB"],
            rows,
            max_rows=_SHOWN_RANKS + 1,
        )
    )


def _group_preview(topo: Topology, name: str, index: int, limit: int = 8) -> str:
    """Like ``_ranks(topo.group_at(name, index))`` without building a 10^6-rank group."""
    size = topo.group_size(name)
    places = list(range(size)) if size <= limit else [*range(limit - 2), size - 1]
    ranks = [topo.rank_at(name, index, place) for place in places]
    if size <= limit:
        return _ranks(ranks)
    return "[" + ",".join(map(str, ranks[:-1])) + f",...,{ranks[-1]}]"


def _group_section(topo: Topology) -> str:
    rows = []
    # With experts, Megatron-core's expert groups follow the dense ones ("ep" is one of them).
    names = [n for n in STANDARD_GROUPS if n != "ep" or not topo.has_experts]
    if topo.hsdp:  # hybrid sharding's two parts of dp, after it
        at = names.index("dp") + 1
        names[at:at] = list(HSDP_AXES)
    for name in names + (list(EXPERT_GROUPS) if topo.has_experts else []):
        count = topo.group_count(name)
        shown = " ".join(_group_preview(topo, name, i) for i in range(min(count, 3)))
        rows.append([name, topo.group_size(name), count, shown + (" ..." if count > 3 else "")])
    head = (
        f"Rank groups: order {topo.order!r} (first varies fastest); mesh shape "
        f"{topo.mesh_shape} axes {topo.mesh_axis_names}"
    )
    if topo.has_experts:
        head += f"; expert mesh shape {topo.expert_mesh_shape} axes {topo.expert_mesh_axis_names}"
    return head + "\n" + _table(["group", "size", "count", "ranks"], rows, max_rows=20)


def _owners(
    specs: list[ParamSpec], args: argparse.Namespace, ranks: int, partition: str
) -> tuple[BucketPlan, ShardPlan]:
    """``specs``' buckets and their ZeRO owners over ``ranks`` ranks (dp, or edp for experts);
    ``partition`` is ``--partition``'s, or ``"flat"`` for ``--zero 2``, which needs it."""
    cap, first = bucket_caps(args.bucket_cap_mb)
    pad_to = math.lcm(args.pad_to, ranks) if partition == "flat" else args.pad_to
    buckets = plan_buckets(specs, cap_bytes=cap, first_cap_bytes=first, pad_to=pad_to)
    if partition != "flat":
        return buckets, plan_greedy_shards(specs, world_size=ranks)
    # shard_optimizer's auto cuts every parameter (flat by parameter: range r of each), and
    # takes the bucketed layout when a zero-size parameter has no range; ZeRO-2
    # reduce-scatters the gradient buckets, so its shards follow those instead.
    sized = all(spec.numel for spec in specs if spec.requires_grad)
    by_param = args.partition == "auto" and args.zero != 2 and sized
    cut = plan_param_buckets(specs, pad_to=ranks) if by_param else buckets
    # A piece per rank and bucket, plus one per parameter straddling a cut: bound them first.
    pieces = sum(len(b.slots) for b in cut.buckets) + len(cut.buckets) * ranks
    if pieces > MAX_FLAT_PIECES:
        if by_param:
            fix = "; use --partition greedy"
        elif args.zero == 2:
            fix = "; raise --bucket-cap-mb (ZeRO-2 needs the flat partition)"
        else:
            fix = "; raise --bucket-cap-mb or use --partition greedy"
        raise UsageError(
            f"a flat partition of {len(cut.buckets)} buckets over {ranks:,} ranks has up to "
            f"{pieces:,} pieces, more than {MAX_FLAT_PIECES:,}" + fix
        )
    return buckets, plan_flat_shards(cut, world_size=ranks)


def _partition(args: argparse.Namespace) -> str:
    """``--partition``: greedy by default (torch's ZeroRedundancyOptimizer); ``auto`` is
    ``shard_optimizer``'s rule, flat by parameter when the optimizer's update is elementwise,
    which every ``--optimizer`` the command line knows is (Adam, SGD, Lion, ...: the state
    columns assume one); a coupling optimizer (Shampoo, Muon) would not be flat under auto."""
    if args.partition == "auto":
        return "flat"
    return args.partition or "greedy"


def _shape_note(topo: Topology) -> str | None:
    """With model parallelism the sizes are per rank only if the shapes given are: say so."""
    axes = [f"--{a} {getattr(topo, a)}" for a in ("tp", "pp", "ep") if getattr(topo, a) > 1]
    if not axes:
        return None
    return (
        f"note: with {' '.join(axes)}, buckets and shards use the parameter shapes as given "
        "(the planner cannot know how this model splits over tp, pp and ep); for per-rank "
        "sizes give one "
        "rank's shapes (its tensor-parallel slices, its pipeline stage, its experts) with "
        f"--params, or plan a built-in Llama ({', '.join(LLAMA_MODELS)}) with --zero 3"
    )


def _summary(source: str, specs: Sequence[ParamSpec], topo: Topology) -> str:
    """The first lines of the plan: parameters (elements) and tensors, the world's axes, and
    a note when model parallelism makes the shapes given per-rank only if they are."""
    trainable = [s for s in specs if s.requires_grad]
    line = (
        f"Model {source}: {sum(s.numel for s in trainable):,} trainable parameters in "
        f"{len(specs)} tensors ({len(trainable)} trainable), "
        f"{_mib(sum(s.nbytes for s in trainable))} MiB; world size {topo.world_size} = "
        + (
            f"tp {topo.tp} x cp {topo.cp} x dp {topo.dp} x pp {topo.pp}; experts: etp "
            f"{topo.etp} x ep {topo.ep} x edp {topo.edp} x pp {topo.pp}"
            if topo.has_experts
            else f"tp {topo.tp} x cp {topo.cp} x ep {topo.ep} x dp {topo.dp} x pp {topo.pp}"
        )
    )
    note = _shape_note(topo)
    return line if note is None else f"{line}\n{note}"


def _source(args: argparse.Namespace) -> tuple[list[ParamSpec], tuple[str, ...]]:
    """The parameters to plan and the names of the tied ones: a ``--params`` file, a live
    model (``--model MODULE:FUNCTION``) or a built-in model."""
    if args.params:
        return _load_params(args.params)
    if is_live_model(args.model):
        return live_model(args.model)
    return builtin_model(args.model, args.dtype), BUILTIN_TIED.get(args.model, ())


def _topology(args: argparse.Namespace, dp_shard: int | None = None) -> Topology:
    return Topology.create(
        args.world_size,
        tp=args.tp,
        cp=args.cp,
        ep=args.ep,
        pp=args.pp,
        order=args.order,
        etp=args.etp,
        dp_shard=dp_shard,
    )


def _dp_replicate(args: argparse.Namespace, dp: int) -> None:
    """``--dp-replicate R``: ``--dp-shard`` becomes ``dp / R``; given both, ``R x S = dp``."""
    replicas = args.dp_replicate
    if replicas is None:
        return
    if args.zero is not None and args.zero != 3:
        raise ValueError("--dp-replicate applies to --zero 3 only (hybrid sharding)")
    if dp % replicas:
        raise ValueError(
            f"--dp-replicate {replicas} does not divide the data-parallel size {dp} "
            "(world size / (tp * cp * pp)); pick a divisor"
        )
    if args.dp_shard is None and args.shard_size is None:
        args.dp_shard = dp // replicas
    elif (args.dp_shard or args.shard_size) * replicas != dp:
        raise ValueError(
            f"--dp-replicate {replicas} x --dp-shard {args.dp_shard or args.shard_size} is not "
            f"the data-parallel size {dp} (world size / (tp * cp * pp)); give sizes whose "
            "product is dp, or one of the two"
        )


def _plan(args: argparse.Namespace) -> int:
    _check_bounds(args)
    specs, tied = _source(args)
    topo = _topology(args)
    _dp_replicate(args, topo.dp)
    check_zero_arguments(args, topo.dp)  # checks --dp-shard against dp, in the flag's words
    if args.dp_shard is not None:
        topo = _topology(args, dp_shard=args.dp_shard)
    if cost_requested(args):
        return cost_command(args, specs, tied_names(args, tied))
    wants_activations = args.batch is not None or args.seq is not None
    if wants_activations and (args.zero != 3 or args.params or args.model not in LLAMA_MODELS):
        raise UsageError(
            "--batch and --seq count the activations of a built-in Llama ("
            + ", ".join(LLAMA_MODELS)
            + ") under --zero 3; add --zero 3 with one of them, or leave the flags out"
        )
    if pipeline_requested(args) and not composed_requested(args):
        return pipeline_command(args, specs, topo)
    if args.zero is not None:
        return _zero(args, specs, tied, topo)
    # Expert parameters (ParamSpec.expert) are owned over edp, the rest over dp (design §6).
    dense, experts = split_expert_specs(specs)
    partition = _partition(args)
    buckets, shards = _owners(dense, args, topo.dp, partition)
    expert_shards = _owners(experts, args, topo.edp, partition)[1] if experts else None
    if args.json:
        out = plan_report(buckets, shards, topo, expert_shards)
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    print(_summary(args.params or args.model, specs, topo))
    print()
    print(_bucket_section(buckets), end="\n\n")
    print(_shard_section(shards, specs), end="\n\n")
    if expert_shards is not None:
        print(_shard_section(expert_shards, specs, axis="edp"), end="\n\n")
    print(_group_section(topo), end="\n\n")
    print(
        f"fingerprints: buckets {buckets.fingerprint[:16]}  shards {shards.fingerprint[:16]}"
        f"  topology {topo.fingerprint[:16]}"
    )
    return 0


def _zero(
    args: argparse.Namespace, specs: list[ParamSpec], tied: Sequence[str], topo: Topology
) -> int:
    """``--zero``: per-rank memory of model states over the data-parallel ranks; ``tied``
    names the tied weights of the source (``--tied`` overrides it)."""
    shape = None if args.params else LLAMA_MODELS.get(args.model)
    if shape is not None and args.zero == 3:
        return _composed(args, shape, topo)
    if any(s.expert for s in specs):
        raise UsageError(
            "--zero does not estimate expert parameters (ParamSpec.expert) yet; "
            "plan a model with experts without --zero"
        )
    plans = None
    if args.zero != 3:  # ZeRO-2 cuts gradients by element ranges: flat whatever the default
        partition = "flat" if args.zero == 2 else _partition(args)
        plans = _owners(specs, args, topo.dp, partition)
    tied = tied_names(args, tied)
    estimate, plan = zero_estimate(specs, args, topo.dp, plans, tied)
    staging = save_staging(specs, estimate, None if plans is None else plans[1], plan)
    if args.json:
        out = report_header() | zero_json(estimate, plan, staging) | {"topology": topo.to_json()}
        out.setdefault("fingerprints", {})["topology"] = topo.fingerprint
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    trainable = [s for s in specs if s.requires_grad]
    print(
        f"Model {args.params or args.model}: {sum(s.numel for s in specs):,} parameters in "
        f"{len(specs)} tensors ({len(trainable)} trainable), "
        f"{_mib(sum(s.nbytes for s in specs))} MiB; dp {topo.dp} of world size "
        f"{topo.world_size}"
    )
    note = _shape_note(topo)
    if note is not None:
        print(note)
    print()
    print(zero_text(estimate, plan, tied, staging))
    return 0


def _composed(args: argparse.Namespace, shape: LlamaShape, topo: Topology) -> int:
    """``--zero 3`` for a built-in Llama: bytes per rank with every axis divided."""
    rows = composed_estimate(shape, args, topo)
    if args.json:
        out = report_header() | composed_json(rows) | {"topology": topo.to_json()}
        out["fingerprints"] = {"topology": topo.fingerprint}
        print(json.dumps(out, indent=1, sort_keys=True))
        return 0
    specs = shape.specs(args.dtype)
    print(
        f"Model {args.model}: {sum(s.numel for s in specs):,} parameters in {len(specs)} "
        f"tensors, {_mib(sum(s.nbytes for s in specs))} MiB; world size {topo.world_size} = "
        f"dp_replicate {topo.dp_replicate} x dp_shard {topo.dp_shard} x cp {topo.cp} x tp "
        f"{topo.tp} x pp {topo.pp}" + (f"; ep {topo.ep} of dp" if topo.ep > 1 else "")
    )
    print()
    print(composed_text(rows, topo, args.optimizer))
    return 0


def _add_source_arguments(plan: argparse.ArgumentParser) -> None:
    """Where the parameters come from: a built-in model, a live one or a JSON file."""
    source = plan.add_mutually_exclusive_group()
    source.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"built-in model: {', '.join(MODELS)}; or MODULE:FUNCTION, a function taking no "
        "arguments that returns a torch nn.Module, a Flax NNX module or a JAX parameter tree "
        "(MODULE: a module on the Python path or in the current directory, or a .py file; "
        "imports that framework)",
    )
    source.add_argument(
        "--params",
        metavar="FILE",
        help='JSON list of parameters, e.g. [{"name": "fc.weight", "shape": [10, 4]}], or '
        '{"params": [...], "tied": ["wte.weight"]}; '
        f"at most {MAX_PARAMS_FILE_BYTES >> 20} MiB",
    )
    plan.add_argument(
        "--dtype",
        default="float32",
        choices=sorted(DTYPE_ITEMSIZE),
        help="dtype of a built-in model's parameters",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="gradsync", description="Show gradsync plans for a model.")
    parser.add_argument("--version", action="version", version=f"gradsync {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    plan = sub.add_parser(
        "plan",
        help="bucket layout, shard partition and rank groups for a model, or per-rank memory "
        "under ZeRO-0/1/2/3 (--zero)",
        description="Print the bucket layout, optimizer-state partition and rank groups; with "
        "--zero, per-rank bytes of parameters, gradients, optimizer state and the peak.",
    )
    _add_source_arguments(plan)
    most = f"{MAX_WORLD_SIZE:,}"
    plan.add_argument(
        "--world-size", type=int, default=8, help=f"number of ranks, 1 to {most} (default 8)"
    )
    plan.add_argument(
        "--cp", type=int, default=1, help=f"context-parallel size, 1 to {most} (default 1)"
    )
    for axis, what in (("tp", "tensor"), ("ep", "expert"), ("pp", "pipeline")):
        plan.add_argument(
            f"--{axis}",
            type=int,
            default=1,
            help=f"{what}-parallel size, 1 to {most} (default 1); buckets and shards use the "
            "shapes given: pass one rank's shapes with --params for per-rank sizes",
        )
    plan.add_argument(
        "--etp",
        type=int,
        default=None,
        help=f"expert tensor-parallel size, 1 to {most} (default: --tp, as Megatron-core)",
    )
    plan.add_argument(
        "--dp-shard",
        type=int,
        default=None,
        help="hybrid sharding (HSDP): cut parameters over groups of this many consecutive dp "
        "ranks (one node) and replicate across the groups; a divisor of dp (default: all dp "
        "ranks). Adds the dp_shard and dp_replicate groups; --zero 3 plans with it",
    )
    plan.add_argument(
        "--dp-replicate",
        type=int,
        default=None,
        help="hybrid sharding's replica count, as examples/llama_nd.py takes it: dp / "
        "dp_replicate ranks shard (--dp-shard's default then); with --dp-shard their product "
        "must be dp",
    )
    plan.add_argument("--order", default=DEFAULT_ORDER, help="rank order, first varies fastest")
    plan.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help=f"bucket cap in MiB, above 0 and at most {MAX_BUCKET_CAP_MB:,.0f} "
        "(default: DDP's 25 MiB with a 1 MiB first bucket)",
    )
    plan.add_argument(
        "--partition",
        choices=("greedy", "flat", "auto"),
        default=None,
        help="optimizer-state partition: whole parameters (greedy, the default, torch's), flat "
        "element ranges of buckets, or auto (shard_optimizer's: a range of every parameter per "
        f"rank, as every --optimizer is elementwise); flat: at most {MAX_FLAT_PIECES:,} pieces",
    )
    plan.add_argument(
        "--pad-to",
        type=int,
        default=1,
        help=f"round bucket lengths up to a multiple of this, 1 to {MAX_PAD_TO:,}",
    )
    add_zero_arguments(plan)
    add_pipeline_arguments(plan)
    add_cost_arguments(plan)
    plan.add_argument("--json", action="store_true", help="emit the plans as JSON")
    plan.set_defaults(run=_plan)
    add_checkpoint_parser(sub)
    add_calibrate_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradsync`` console script; returns the exit code."""
    try:
        args = build_parser().parse_args(argv)
        code: int = args.run(args)
        return code
    except (UsageError, ValueError, TypeError) as e:
        print(f"gradsync: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `gradsync plan | head`
        return 0
