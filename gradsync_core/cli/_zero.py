"""``gradsync plan --zero 0|1|2|3``: per-rank model-state bytes and the peak.

Parameters, gradients, optimizer state and the peak, as DeepSpeed's memory estimator prints
them (docs/design.md §16).

ZeRO-0 is DDP (everything replicated), 1 shards optimizer state, 2 gradients too, 3 the
parameters as well (``plan_param_shards``: FSDP2's units and dim-0 chunks).

For ZeRO-1/2/3 it also prints each rank's save staging: the host bytes a save with
``blocking=False`` copies before it returns (the state the rank owns, the estimate's, plus
the model weights its file holds when the save stores them), allocated at the first such
save and reused (docs/checkpoints.md, "Saves that do not stop training").
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

from gradsync_core.checkpoint._model_weights import weight_bytes
from gradsync_core.checkpoint._param_shard_state import plan_dim0_shards
from gradsync_core.cli._table import mib, shown, table
from gradsync_core.plan._buckets import BucketPlan
from gradsync_core.plan._llama import (
    EXECUTORS,
    Activations,
    LlamaShape,
    StageMemory,
    llama_memory,
)
from gradsync_core.plan._memory import (
    OPTIMIZER_STATE_BYTES,
    MemoryEstimate,
    estimate_ddp,
    estimate_zero1,
    estimate_zero2,
    estimate_zero3,
)
from gradsync_core.plan._param_shards import ParamShardPlan, plan_param_shards
from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan._topology import Topology

# --zero lists every data-parallel rank in --json: bounded so the output stays a few MiB.
MAX_ZERO_RANKS = 1 << 16
_SHOWN_RANKS = 16
# Built-in models' tied weights (gpt2_small lists lm_head's weight once, as wte's): autograd
# accumulates their gradients, which the ZeRO-3 estimate counts (estimate_zero3's ``tied``).
BUILTIN_TIED = {"gpt2-small": ("transformer.wte.weight",)}
_STAGE = {
    0: "ZeRO-0 (DDP: all replicated)",
    1: "ZeRO-1 (optimizer state sharded)",
    2: "ZeRO-2 (gradients and state sharded)",
    3: "ZeRO-3 (parameters, gradients and state sharded, FSDP2's cut)",
}


def add_zero_arguments(plan: argparse.ArgumentParser) -> None:
    """The ``--zero`` options of ``gradsync plan``."""
    plan.add_argument(
        "--zero",
        type=int,
        choices=(0, 1, 2, 3),
        default=None,
        help="print per-rank memory of parameters, gradients and optimizer state under this "
        f"ZeRO stage (0 = DDP) instead of the plans; at most {MAX_ZERO_RANKS:,} dp ranks",
    )
    plan.add_argument(
        "--units",
        default=None,
        metavar="PREFIXES",
        help="--zero 3: comma-separated module prefixes gathered as units (one fully_shard "
        "each, the root implied); default: the first numbered module of each parameter, "
        "e.g. transformer.h.0, transformer.h.1, ...",
    )
    plan.add_argument(
        "--shard-size",
        type=int,
        default=None,
        help="deprecated spelling of --dp-shard",
    )
    plan.add_argument(
        "--tied",
        default=None,
        metavar="NAMES",
        help="--zero 3: comma-separated parameters used twice (tied weights), listed by the "
        "name they have in the model; default: gpt2-small's embedding, a torch --model's "
        '(found by identity), the --params file\'s "tied" list; none otherwise',
    )
    plan.add_argument(
        "--batch",
        type=int,
        default=None,
        metavar="ROWS",
        help="--zero 3 with a built-in Llama: the global batch in rows; with --seq, each rank's "
        "row adds the activations it holds at its peak (with --pp, of the peak stash of "
        "--schedule over --microbatches)",
    )
    plan.add_argument(
        "--seq",
        type=int,
        default=None,
        metavar="TOKENS",
        help="--zero 3 with a built-in Llama: the sequence length (with --batch)",
    )
    plan.add_argument(
        "--no-sequence-parallel",
        action="store_true",
        help="--batch/--seq: the activations of a run without sequence parallelism "
        "(examples/llama_torch.py's ParallelOptions.sequence_parallel is on by default)",
    )
    plan.add_argument(
        "--executor",
        choices=EXECUTORS,
        default="torch",
        help="--batch/--seq: whose program holds the activations and gathered parameters: "
        "torch (examples/llama_torch.py, autograd's saved tensors; the default) or jax "
        "(examples/llama_nnx.py's parallelize: one sequence-parallel gather per attention "
        "and MLP, the dp_shard gathers kept for the backward); with --cost, whose ZeRO-3 "
        "step's peak (jax: zero3_step's one XLA program, docs/cost-model.md)",
    )
    plan.add_argument(
        "--optimizer",
        default="adam",
        help=f"optimizer state per element: {', '.join(OPTIMIZER_STATE_BYTES)}, or a number "
        "of bytes per element (default adam: two fp32 moments, 8 bytes)",
    )


def _names(value: str) -> list[str]:
    return [name.strip() for name in value.split(",") if name.strip()]


def tied_names(args: argparse.Namespace, source: Sequence[str]) -> tuple[str, ...]:
    """The tied weights ZeRO-3 counts: ``--tied`` if given, else the source's (gpt2-small's
    embedding, a torch model's found by identity, a parameter file's ``"tied"`` list)."""
    return tuple(source) if args.tied is None else tuple(_names(args.tied))


def _optimizer(value: str) -> str | int:
    return int(value) if value.isdigit() else value


def _dp_shard(args: argparse.Namespace, dp: int) -> None:
    """Check ``--dp-shard`` against dp; ``--shard-size``, its deprecated spelling, becomes it
    and warns on stderr once the check passed (an error stays one line)."""
    flag = "--dp-shard"
    if args.shard_size is not None:
        if args.dp_shard is not None:
            raise ValueError("--shard-size is the deprecated spelling of --dp-shard; pass one")
        args.dp_shard, args.shard_size, flag = args.shard_size, None, "--shard-size"
    if args.dp_shard is not None and not (1 <= args.dp_shard <= dp and dp % args.dp_shard == 0):
        raise ValueError(
            f"{flag} must divide the data-parallel size {dp}, got {args.dp_shard} (hybrid "
            "sharding cuts each data-parallel group into shard groups of that many ranks)"
        )
    if flag == "--shard-size":
        print(
            "gradsync: warning: --shard-size is deprecated and will be removed: use --dp-shard",
            file=sys.stderr,
        )


def check_zero_arguments(args: argparse.Namespace, dp: int) -> None:
    """Refuse options that do not apply to the chosen stage, before anything is planned;
    ``--shard-size`` (deprecated) becomes ``--dp-shard``."""
    if args.zero is None:
        for flag in ("units", "shard_size", "tied"):
            if getattr(args, flag) is not None:
                raise ValueError(f"--{flag.replace('_', '-')} applies to --zero 3 only")
    elif args.zero != 3 and (args.units, args.dp_shard, args.shard_size, args.tied) != (
        None,
        None,
        None,
        None,
    ):
        raise ValueError("--units, --dp-shard (--shard-size) and --tied apply to --zero 3 only")
    _dp_shard(args, dp)
    if args.zero is None:
        return
    if args.zero == 2 and args.partition == "greedy":
        raise ValueError("ZeRO-2 cuts gradients into flat element ranges; drop --partition greedy")
    if dp > MAX_ZERO_RANKS:
        raise ValueError(
            f"--zero lists every data-parallel rank; {dp:,} is more than {MAX_ZERO_RANKS:,}"
        )


def zero_estimate(
    specs: Sequence[ParamSpec],
    args: argparse.Namespace,
    dp: int,
    plans: tuple[BucketPlan, ShardPlan] | None,
    tied: Sequence[str] = (),
) -> tuple[MemoryEstimate, ParamShardPlan | None]:
    """The estimate for ``args.zero`` over ``dp`` ranks; ``plans`` are ZeRO-0/1/2's buckets and
    shards, ``None`` for ZeRO-3, which plans its own units; ``tied``: ``tied_names``."""
    optimizer = _optimizer(args.optimizer)
    if args.zero == 3:
        units = block_prefixes(specs) if args.units is None else _names(args.units)
        plan = plan_param_shards(specs, world_size=dp, units=units, dp_shard=args.dp_shard)
        return estimate_zero3(plan, optimizer=optimizer, tied=tied), plan
    assert plans is not None  # the caller plans buckets and shards for stages 0-2
    buckets, shards = plans
    if args.zero == 0:
        return estimate_ddp(specs, buckets, world_size=dp, optimizer=optimizer), None
    if args.zero == 1:
        return estimate_zero1(specs, buckets, shards, optimizer=optimizer), None
    return estimate_zero2(specs, shards, optimizer=optimizer), None


def save_staging(
    specs: Sequence[ParamSpec],
    estimate: MemoryEstimate,
    shards: ShardPlan | None,
    plan: ParamShardPlan | None,
) -> list[tuple[int, int]] | None:
    """Each rank's save staging, ``(state bytes, weight bytes)``: the state it owns (the
    estimate's) and the weights its file holds when the save stores the model (ZeRO-3: rank 0,
    which holds every parameter's first rows); ``None`` for ZeRO-0, whose save is one rank's."""
    if estimate.zero == 0:
        return None
    if plan is not None:
        shards = plan_dim0_shards(specs, [0] * len(specs), shard_size=plan.shard_size)
    assert shards is not None  # ZeRO-1/2: the caller's shard plan
    weights = weight_bytes(shards, specs)
    return [(r.optimizer_state_bytes, weights[r.rank]) for r in estimate.ranks]


def zero_json(
    estimate: MemoryEstimate,
    plan: ParamShardPlan | None,
    staging: Sequence[tuple[int, int]] | None = None,
) -> dict[str, Any]:
    """``--json``: the estimate, the save staging, and for ZeRO-3 the parameter-shard plan and
    its fingerprint."""
    out: dict[str, Any] = {"memory": estimate.to_json()}
    if staging is not None:
        out["save_staging"] = [
            {"rank": r, "state_bytes": state, "weight_bytes": weights}
            for r, (state, weights) in enumerate(staging)
        ]
    if plan is not None:
        out["param_shards"] = plan.to_json()
        out["fingerprints"] = {"param_shards": plan.fingerprint}
    return out


def _units_section(plan: ParamShardPlan) -> str:
    rows = []
    for unit in plan.units:
        local = plan.unit_padded_nbytes(unit.index)
        rows.append(
            [
                unit.index,
                repr(unit.prefix),
                len(unit.params),
                f"{sum(plan.chunk(n, 0).padded_numel for n in unit.params) * plan.shard_size:,}",
                mib(local * plan.shard_size),
                mib(local),
            ]
        )
    head = (
        f"Units: {len(plan.units)} (root first, then module order; sharded over "
        f"{plan.shard_size} ranks x {plan.replicate_size} replicas)"
    )
    headers = ["unit", "prefix", "params", "gathered elements", "gathered MiB", "MiB/rank"]
    return head + "\n" + table(headers, rows)


def _staging_section(what: str, staging: Sequence[tuple[int, int]]) -> str:
    rows: list[Sequence[Any]] = [
        [r, mib(staging[r][0]), mib(sum(staging[r]))] for r in shown(len(staging), _SHOWN_RANKS)
    ]
    if len(staging) > _SHOWN_RANKS:
        rows.insert(_SHOWN_RANKS // 2, ["..."] * 3)
    head = (
        "Save staging per rank (blocking=False: host bytes copied before the save returns, "
        "allocated once)"
    )
    headers = [what, "state MiB", "with model weights MiB"]
    return head + "\n" + table(headers, rows, max_rows=_SHOWN_RANKS + 1)


def zero_text(
    estimate: MemoryEstimate,
    plan: ParamShardPlan | None,
    tied: Sequence[str] = (),
    staging: Sequence[tuple[int, int]] | None = None,
) -> str:
    """The text report: ZeRO-3's units and tied weights, then per-rank MiB, the fullest rank
    and each rank's save staging."""
    what = "shard rank" if estimate.zero == 3 else "dp rank"
    rows: list[Sequence[Any]] = [
        [
            r.rank,
            mib(r.parameter_bytes),
            mib(r.gradient_bytes),
            mib(r.optimizer_state_bytes),
            mib(r.transient_bytes),
            mib(r.peak_bytes),
        ]
        for r in (estimate.ranks[i] for i in shown(len(estimate.ranks), _SHOWN_RANKS))
    ]
    if len(estimate.ranks) > _SHOWN_RANKS:
        rows.insert(_SHOWN_RANKS // 2, ["..."] * 6)
    fullest = estimate.max
    lines = [
        f"{_STAGE[estimate.zero]} over {estimate.world_size} dp ranks; optimizer state "
        f"{estimate.state_bytes_per_element} bytes per trainable element",
        "",
    ]
    if plan is not None:
        lines += [_units_section(plan), ""]
        lines += [
            "tied weights (their gradient accumulated from two uses): "
            + (", ".join(tied) if tied else "none (name them with --tied)"),
            "",
        ]
    headers = [what, "params MiB", "grads MiB", "state MiB", "transient MiB", "peak MiB"]
    lines += [
        "Per-rank memory of model states (activations not counted; transient: bucket "
        "buffers, or gathered units and one unit's full gradients)",
        table(headers, rows, max_rows=_SHOWN_RANKS + 1),
        "",
        f"fullest: {what} {fullest.rank}, peak {mib(fullest.peak_bytes)} MiB",
    ]
    if plan is not None:
        lines.append(f"fingerprint: param_shards {plan.fingerprint[:16]}")
    if staging is not None:
        lines += ["", _staging_section(what, staging)]
    return "\n".join(lines)


def composed_estimate(
    shape: LlamaShape, args: argparse.Namespace, topo: Topology
) -> tuple[StageMemory, ...]:
    """``--zero 3`` for a built-in Llama: the fullest rank of each pipeline stage on ``topo``
    (``llama_memory``: its tp/ep slice of the stage, cut over dp_shard and edp)."""
    if args.units is not None:
        raise ValueError(
            "--units does not apply to a built-in Llama: its units are its layers, as "
            "examples/llama_torch.py wraps them"
        )
    activations = None
    if (args.batch is None) != (args.seq is None):
        raise ValueError(
            "activations need both --batch ROWS and --seq TOKENS; give both or neither"
        )
    if args.batch is not None:
        activations = Activations(
            batch=args.batch,
            seq_len=args.seq,
            schedule=args.schedule,
            microbatches=1 if args.microbatches is None else args.microbatches,
            sequence_parallel=not args.no_sequence_parallel,
            executor=args.executor,
        )
    return llama_memory(
        shape,
        topo,
        dtype=args.dtype,
        optimizer=_optimizer(args.optimizer),
        activations=activations,
    )


def composed_requested(args: argparse.Namespace) -> bool:
    """Whether ``--batch``/``--seq`` ask for the composed rows with activations (then
    ``--schedule`` and ``--microbatches`` describe the pipeline those rows stash)."""
    return args.zero == 3 and (args.batch is not None or args.seq is not None)


def composed_json(rows: Sequence[StageMemory]) -> dict[str, Any]:
    """``--json``: one object per pipeline rank, its layers, elements and bytes."""
    return {
        "composed_memory": [
            {
                "pp_rank": row.pp_rank,
                "layers": [row.layers.start, row.layers.stop],
                "numel": row.numel,
            }
            | {k: v for k, v in row.memory.to_json().items() if k != "rank"}
            | {
                "model_state_peak_bytes": row.memory.peak_bytes,
                "activation_bytes": row.activation_bytes,
                "stash": row.stash,
                "peak_bytes": row.peak_bytes,
            }
            for row in rows
        ]
    }


def composed_text(rows: Sequence[StageMemory], topo: Topology, optimizer: str) -> str:
    """The text report: one row per pipeline rank, then the fullest."""
    counted = any(row.stash for row in rows)
    body = [
        [
            row.pp_rank,
            f"{row.layers.start}-{row.layers.stop - 1}" if row.layers else "-",
            f"{row.numel:,}",
            mib(row.memory.parameter_bytes),
            mib(row.memory.gradient_bytes),
            mib(row.memory.optimizer_state_bytes),
            mib(row.memory.transient_bytes),
            *([f"{mib(row.activation_bytes)} ({row.stash})"] if counted else []),
            mib(row.peak_bytes),
        ]
        for row in rows[:_SHOWN_RANKS]
    ]
    fullest = max(rows, key=lambda r: (r.peak_bytes, -r.pp_rank))
    shard = f"dp_shard {topo.dp_shard} x dp_replicate {topo.dp_replicate}"
    experts = f"; experts over ep {topo.ep} x edp {topo.edp}" if topo.has_experts else ""
    headers = [
        "pp rank",
        "layers",
        "elements",
        "params MiB",
        "grads MiB",
        "state MiB",
        "transient MiB",
        *(["activations MiB (stash)"] if counted else []),
        "peak MiB",
    ]
    what = (
        "Per-rank memory, the fullest rank of each stage: model states and the activations "
        "autograd saves for the microbatches the rank stashes at its peak (docs/nd-parallel.md; "
        "elements: before fully_shard)"
        if counted
        else "Per-rank memory of model states, the fullest rank of each stage (activations not "
        "counted: give --batch and --seq; elements: before fully_shard)"
    )
    return "\n".join(
        [
            f"Composed: each rank holds its pipeline stage's layers, cut over tp {topo.tp}, "
            f"then fully_shard over {shard}{experts} (cp {topo.cp} divides activations only); "
            f"optimizer {optimizer}",
            "",
            what,
            table(headers, body, max_rows=_SHOWN_RANKS),
            "",
            f"fullest: pp rank {fullest.pp_rank}, peak {mib(fullest.peak_bytes)} MiB",
        ]
    )
