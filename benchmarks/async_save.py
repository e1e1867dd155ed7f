"""Saves that do not stop training: how long a save blocks a training step, sync and async,
against DCP's ``async_save`` and Orbax's async checkpointer (issue 39; docs/checkpoints.md).

The same model state in both frameworks: the benchmarks' MLP (24 x 1024 x 1024 by default,
25.2M parameters) with its Adam state, about 300 MB. Torch: 2 gloo ranks, gradsync DataParallel
and ZeRO-1 (benchmarks/_async_save_torch.py); JAX: 8 CPU devices, ``shard_optimizer(adam)``
(benchmarks/_async_save_jax.py, in a process of its own). Every variant saves the same state
from the same training loop, alternating round by round (docs/design.md §11):

    torch   gradsync blocking / blocking=False (its writer paced, and unpaced), DCP save,
            DCP async_save in thread and in process mode, and gradsync's writer alone in a
            thread and in a process (issue 39, item 1: "thread or process, measure both")
    JAX     gradsync blocking / blocking=False, Orbax save, Orbax AsyncCheckpointer

For each: the time the save blocks the training (its call; the slowest rank), and the training
steps that run while its write goes on against a quiet step (no save in flight).

    python benchmarks/async_save.py --repeat 3
    python benchmarks/async_save.py --quick        # 8 x 1024 (8.4M parameters), < 2 minutes
    python benchmarks/async_save.py --torch-only   # the torch part alone (its ratios only)

The last line is one JSON object: {"bench": "async_save", "ratio_vs_anchor": gradsync async's
blocked time over gradsync's blocking save (target <= 0.10), "dcp_thread_ratio_vs_anchor" and
"dcp_process_ratio_vs_anchor": gradsync async's blocked time over DCP async's (target <= 1),
"steps_ratio_vs_anchor": a torch step during gradsync's write over a quiet one (target
<= 1.10; the median step in flight), "total_steps_ratio_vs_anchor": the save's call, the fixed
steps after it and the wait for its end over as many quiet steps (a second figure, which does
not move with how many steps the save's length puts in flight; also for the writer process
alone: "writer_process_total_steps_ratio_vs_anchor"), the same for JAX
("jax_ratio_vs_anchor", "orbax_ratio_vs_anchor": over Orbax async's,
"jax_steps_ratio_vs_anchor"), the writer's thread against process
("writer_process_blocked_ratio_vs_anchor", "writer_thread_steps_ratio_vs_anchor",
"writer_process_steps_ratio_vs_anchor"), gradsync's writer unpaced
("unpaced_steps_ratio_vs_anchor", "unpaced_total_steps_ratio_vs_anchor"), "torch": {...},
"jax": {...}}.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import _async_save_torch as tsave
from _jax_part import run_jax_part
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks

from gradsync_core.checkpoint import WRITER_SHARE

JAX_VARIANTS = ("gradsync, blocking", "gradsync, blocking=False", "Orbax save", "Orbax async")


def _jax(args: argparse.Namespace, directory: str) -> dict[str, Any]:
    """The JAX part, in a process of its own (8 CPU devices, no torch)."""
    options = {
        "dir": directory,
        "layers": args.layers,
        "width": args.width,
        "batch": args.jax_batch,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "quiet_steps": args.quiet_steps,
        "during_steps": args.during_steps,
    }
    result: dict[str, Any] = run_jax_part("_async_save_jax.py", options)
    return result


def _table(title: str, result: dict[str, Any], variants: tuple[str, ...]) -> None:
    sync = result["variants"][variants[0]]["blocked_s"]
    print(
        f"{title}: {result['params'] / 1e6:.1f} M parameters, "
        f"{result['state_bytes'] / 2**20:.0f} MiB saved, quiet step "
        f"{result['quiet_step_s'] * 1e3:.0f} ms"
    )
    totals = "total_slowdown" in result["variants"][variants[0]]  # torch's
    print(
        f"  {'variant':<26}{'blocked ms':>11}{'vs blocking':>12}{'steps in flight':>16}"
        f"{'step slowdown':>14}" + (f"{'total slowdown':>15}{'save ms':>9}" if totals else "")
    )
    for name in variants:
        row = result["variants"][name]
        print(
            f"  {name:<26}{row['blocked_s'] * 1e3:>11.1f}{row['blocked_s'] / sync:>11.3f}x"
            f"{row['steps_in_flight']:>16}{row['slowdown']:>13.3f}x"
            + (f"{row['total_slowdown']:>14.3f}x{row['save_s'] * 1e3:>9.0f}" if totals else "")
        )


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: the torch ranks, then the JAX process (unless ``--torch-only``); print
    the tables."""
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        run = argparse.Namespace(**vars(args))
        run.dir = os.path.join(root, "torch")  # the ranks' checkpoints
        torch_result = spawn_ranks(tsave.worker, run)
        jax_result = None if args.torch_only else _jax(args, os.path.join(root, "jax"))
    _table(f"torch, {args.world_size} gloo ranks", torch_result, tsave.VARIANTS)
    t = torch_result["variants"]
    blocked = {name: row["blocked_s"] for name, row in t.items()}
    figures = _torch_figures(args, torch_result, blocked)
    if jax_result is None:
        return figures
    _table("JAX, 8 CPU devices", jax_result, JAX_VARIANTS)
    j = jax_result["variants"]
    jax_blocked = {name: row["blocked_s"] for name, row in j.items()}
    return {
        **figures,
        "jax_ratio_vs_anchor": jax_blocked[JAX_VARIANTS[1]] / jax_blocked[JAX_VARIANTS[0]],
        "orbax_ratio_vs_anchor": jax_blocked[JAX_VARIANTS[1]] / jax_blocked[JAX_VARIANTS[3]],
        "jax_steps_ratio_vs_anchor": j[JAX_VARIANTS[1]]["slowdown"],
        "orbax_steps_ratio_vs_anchor": j[JAX_VARIANTS[3]]["slowdown"],
        "jax": jax_result,
    }


def _torch_figures(
    args: argparse.Namespace, torch_result: dict[str, Any], blocked: dict[str, float]
) -> dict[str, Any]:
    """The torch part's ratios and result."""
    t = torch_result["variants"]
    return {
        "bench": "async_save",
        "layers": args.layers,
        "width": args.width,
        "ratio_vs_anchor": blocked[tsave.ASYNC] / blocked[tsave.SYNC],
        "dcp_thread_ratio_vs_anchor": blocked[tsave.ASYNC] / blocked[tsave.DCP_THREAD],
        "dcp_process_ratio_vs_anchor": blocked[tsave.ASYNC] / blocked[tsave.DCP_PROCESS],
        "steps_ratio_vs_anchor": t[tsave.ASYNC]["slowdown"],
        "total_steps_ratio_vs_anchor": t[tsave.ASYNC]["total_slowdown"],
        "unpaced_steps_ratio_vs_anchor": t[tsave.UNPACED]["slowdown"],
        "unpaced_total_steps_ratio_vs_anchor": t[tsave.UNPACED]["total_slowdown"],
        "writer_process_total_steps_ratio_vs_anchor": t[tsave.WRITER_PROCESS]["total_slowdown"],
        "dcp_thread_steps_ratio_vs_anchor": t[tsave.DCP_THREAD]["slowdown"],
        "dcp_process_steps_ratio_vs_anchor": t[tsave.DCP_PROCESS]["slowdown"],
        "writer_process_blocked_ratio_vs_anchor": blocked[tsave.WRITER_PROCESS]
        / blocked[tsave.WRITER_THREAD],
        "writer_thread_steps_ratio_vs_anchor": t[tsave.WRITER_THREAD]["slowdown"],
        "writer_process_steps_ratio_vs_anchor": t[tsave.WRITER_PROCESS]["slowdown"],
        "torch": torch_result,
    }


TORCH_RATIOS = (
    "ratio_vs_anchor",
    "dcp_thread_ratio_vs_anchor",
    "dcp_process_ratio_vs_anchor",
    "steps_ratio_vs_anchor",
    "total_steps_ratio_vs_anchor",
    "unpaced_steps_ratio_vs_anchor",
    "unpaced_total_steps_ratio_vs_anchor",
    "writer_process_total_steps_ratio_vs_anchor",
    "dcp_thread_steps_ratio_vs_anchor",
    "dcp_process_steps_ratio_vs_anchor",
    "writer_process_blocked_ratio_vs_anchor",
    "writer_thread_steps_ratio_vs_anchor",
    "writer_process_steps_ratio_vs_anchor",
)
RATIOS = (
    *TORCH_RATIOS,
    "jax_ratio_vs_anchor",
    "orbax_ratio_vs_anchor",
    "jax_steps_ratio_vs_anchor",
    "orbax_steps_ratio_vs_anchor",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a smaller state, fewer rounds")
    parser.add_argument("--layers", type=int, help="MLP layers (default 24; --quick 8)")
    parser.add_argument("--width", type=int, default=1024, help="MLP width (default 1024)")
    parser.add_argument("--rounds", type=int, help="timed rounds (default 5; --quick 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed rounds first")
    parser.add_argument("--quiet-steps", type=int, default=2, help="steps before each save")
    parser.add_argument("--during-steps", type=int, help="steps after each save (6; quick 3)")
    parser.add_argument("--world-size", type=int, default=2, help="torch gloo ranks")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temp dir)")
    parser.add_argument(
        "--writer-share",
        type=float,
        default=WRITER_SHARE,
        help=f"the paced writer's share of a core (default gradsync's, {WRITER_SHARE})",
    )
    parser.add_argument(
        "--torch-only", action="store_true", help="the torch part alone (no JAX process)"
    )
    add_repeat_arg(parser)
    args = parser.parse_args()
    args.layers = args.layers or (8 if args.quick else 24)
    args.rounds = args.rounds or (2 if args.quick else 5)
    args.during_steps = args.during_steps or (3 if args.quick else 6)
    args.model, args.batch, args.seq = "mlp", 32, 0  # the torch benchmarks' model options
    args.jax_batch = args.batch * 2  # 8 rows per device
    runs = run_repeats(lambda index: measure(args), args.repeat)
    finish(runs, ratio_keys=TORCH_RATIOS if args.torch_only else RATIOS)


if __name__ == "__main__":
    main()
