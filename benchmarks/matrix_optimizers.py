"""Muon under gradsync ZeRO-3: the owner path against AdamW and against the naive exact way.

docs/matrix-optimizers.md; docs/design.md §11: every variant runs in the same process tree,
alternating step by step (the order rotates every round), on the same model and data; each
time is the median over the timed rounds of the slowest rank's step (zero_grad, forward,
loss, backward, the optimizers' steps). All three shard the model with
``gradsync_torch.fully_shard`` (one unit per block, then the root):

    AdamW               torch.optim.AdamW on every parameter's rows (the reference point)
    Muon, owners        gradsync_torch.MatrixOptimizer(torch.optim.Muon(matrices)): each
                        matrix gathered to its planned owner (one all-to-all of gradient and
                        parameter rows), stepped there whole, its rows sent back (another);
                        AdamW on the rest (embeddings, norms, biases)
    Muon, naive         every rank all-gathers every matrix's gradient and parameter, runs
                        torch.optim.Muon on all of them and keeps its rows (exact too, the
                        momentum replicated); AdamW on the rest

Muon's matrices are the blocks' 2-D weights (attention in/out projections, MLP), as Muon's
users pick them. Also printed: the bytes each rank moves per step in the matrices' exchange,
predicted by the plan (``MatrixOwnerPlan.rows_exchange``) and counted by the executor, the
naive way's all-gathers, and the plan's imbalance (the largest rank's Newton-Schulz work over
the mean). The field's reference point for Muon's cost over AdamW under ZeRO-style sharding
is Megatron-core's distributed Muon, 1.5-2.7x.

    python benchmarks/matrix_optimizers.py --repeat 3                 # GPT 4 x 256, 4 ranks
    python benchmarks/matrix_optimizers.py --quick

Also timed alone: the optimizers' part of each step (``opt_step_s``), where Muon's cost shows
without the forward and backward around it.

The last line is one JSON object: {"bench": "matrix_optimizers", "ratio_vs_anchor": Muon
with owners over AdamW (whole steps), "naive_ratio_vs_anchor": the naive way over AdamW,
"opt_ratio_vs_anchor", "opt_naive_ratio_vs_anchor": the same for the optimizers' part,
"owners_vs_naive": owners over naive, "exchange_bytes": [...], "imbalance": ...}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks
from _torch_models import (
    DecoderBlock,
    add_common_args,
    build_model,
    count_params,
    describe,
    fill_model_defaults,
    loss_of,
    make_batch,
)

from gradsync_core import block_prefixes, chunk_rows
from gradsync_torch import MatrixOptimizer, fully_shard, param_specs
from gradsync_torch.param_sharding._rows import as_row_sharded

ADAMW, OWNERS, NAIVE = "AdamW", "Muon, owners", "Muon, naive"
VARIANTS = (ADAMW, OWNERS, NAIVE)
ANCHOR = ADAMW


def _sharded(model: nn.Module) -> nn.Module:
    modules = dict(model.named_modules())
    for prefix in block_prefixes(param_specs(model)):  # one unit per block, then the root
        fully_shard(modules[prefix])
    fully_shard(model)
    return model


def _split(model: nn.Module) -> tuple[list[Any], list[Any]]:
    """(Muon's matrices, the rest): the blocks' 2-D weights, named."""
    in_block = {
        f"{prefix}.{name}"
        for prefix, module in model.named_modules()
        if isinstance(module, DecoderBlock)
        for name, p in module.named_parameters()
        if p.ndim == 2
    }
    matrices = [(n, p) for n, p in model.named_parameters() if n in in_block]
    rest = [(n, p) for n, p in model.named_parameters() if n not in in_block]
    return matrices, rest


class NaiveMuon:
    """The naive exact way: all-gather every matrix (gradient and parameter) on every rank,
    step ``torch.optim.Muon`` on all of them, keep this rank's rows."""

    def __init__(self, matrices: list[Any]) -> None:
        self.params = [p for _, p in matrices]
        self.whole = [torch.empty(p.shape, dtype=p.dtype) for p in self.params]
        self.muon = torch.optim.Muon(self.whole, lr=0.02)
        self.world_size = dist.get_world_size()
        self.rank = dist.get_rank()
        self.received_numel = 0

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        n = self.world_size
        padded = [-(-p.shape[0] // n) * (p.numel() // p.shape[0]) for p in self.params]
        send = torch.zeros(2 * sum(padded))
        offset = 0
        for p, size in zip(self.params, padded, strict=True):
            for t in (p.grad.to_local(), p.to_local()):
                send[offset : offset + t.numel()] = t.reshape(-1)
                offset += size
        recv = torch.empty(n * send.numel())
        dist.all_gather_into_tensor(recv, send)
        self.received_numel = (n - 1) * send.numel()
        pieces = recv.view(n, -1)
        offset = 0
        for p, w, size in zip(self.params, self.whole, padded, strict=True):
            grad = pieces[:, offset : offset + size].reshape(-1)[: p.numel()]
            param = pieces[:, offset + size : offset + 2 * size].reshape(-1)[: p.numel()]
            w.grad = grad.view(p.shape).clone()
            w.copy_(param.view(p.shape))
            offset += 2 * size
        self.muon.step()
        for p, w in zip(self.params, self.whole, strict=True):
            start, stop, _ = chunk_rows(p.shape[0], n, self.rank)
            p.copy_(as_row_sharded(w[start:stop], p))


def _setup(name: str, args: argparse.Namespace) -> tuple[nn.Module, list[Any]]:
    model = _sharded(build_model(args))
    if name == ADAMW:
        return model, [torch.optim.AdamW(model.parameters(), lr=1e-4)]
    matrices, rest = _split(model)
    adamw = torch.optim.AdamW([p for _, p in rest], lr=1e-4)
    if name == OWNERS:
        return model, [MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02)), adamw]
    return model, [NaiveMuon(matrices), adamw]


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        setups = {name: _setup(name, args) for name in VARIANTS}
        batch = make_batch(args, rank, torch.device("cpu"))

        def step(name: str) -> float:
            """One step; returns when the optimizers' part of it began."""
            model, opts = setups[name]
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            loss_of(model, *batch).backward()
            began = time.perf_counter()
            for opt in opts:
                opt.step()
            return began

        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        opt_times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.warmup + args.steps):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                began = step(name)
                end = time.perf_counter()
                elapsed = torch.tensor([end - start, end - began], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                if r >= args.warmup:
                    times[name].append(float(elapsed[0]))
                    opt_times[name].append(float(elapsed[1]))
        owners = setups[OWNERS][1][0]
        naive = setups[NAIVE][1][0]
        itemsize = 4  # float32 matrices
        counted, predicted = owners.exchanged, owners.owner_plan.rows_exchange(rank)
        row = {
            "counted_sent": counted.sent_numel * itemsize,
            "counted_received": counted.received_numel * itemsize,
            "predicted_sent": predicted.sent_numel * itemsize,
            "predicted_received": predicted.received_numel * itemsize,
            "naive_received": naive.received_numel * itemsize,
        }
        rows: list[Any] = [None] * world_size
        dist.all_gather_object(rows, row)
        if rank == 0:
            out.put(
                {
                    "step_s": {n: statistics.median(t) for n, t in times.items()},
                    "opt_step_s": {n: statistics.median(t) for n, t in opt_times.items()},
                    "bytes": rows,
                    "imbalance": owners.owner_plan.imbalance,
                    "matrices": len(owners.owner_plan.matrices),
                    "params": count_params(build_model(args)),
                }
            )
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: spawn the ranks, print the table, return the figures."""
    result = spawn_ranks(worker, args)
    step_s = result["step_s"]
    print(f"{describe(args, result['params'])}, {args.world_size} gloo ranks, gradsync ZeRO-3")
    print(
        f"Muon on {result['matrices']} matrices, owners' Newton-Schulz work "
        f"{result['imbalance'] * 100:.1f} % above the mean at most"
    )
    opt_s = result["opt_step_s"]
    print(f"{'variant':<14}{'step ms':>9}{'vs AdamW':>10}{'optimizers ms':>15}{'vs AdamW':>10}")
    for name in VARIANTS:
        print(
            f"{name:<14}{step_s[name] * 1e3:>9.1f}{step_s[name] / step_s[ANCHOR]:>9.3f}x"
            f"{opt_s[name] * 1e3:>15.1f}{opt_s[name] / opt_s[ANCHOR]:>9.3f}x"
        )
    print("matrix bytes per rank per step (sent / received): owners counted | predicted | naive")
    for rank, row in enumerate(result["bytes"]):
        print(
            f"  rank {rank}: {row['counted_sent']:,} / {row['counted_received']:,} | "
            f"{row['predicted_sent']:,} / {row['predicted_received']:,} | "
            f"received {row['naive_received']:,}"
        )
    return {
        "bench": "matrix_optimizers",
        "world_size": args.world_size,
        "step_s": step_s[OWNERS],
        "anchor_step_s": step_s[ANCHOR],
        "naive_step_s": step_s[NAIVE],
        "ratio_vs_anchor": step_s[OWNERS] / step_s[ANCHOR],
        "naive_ratio_vs_anchor": step_s[NAIVE] / step_s[ANCHOR],
        "owners_vs_naive": step_s[OWNERS] / step_s[NAIVE],
        "opt_step_s": result["opt_step_s"],
        "opt_ratio_vs_anchor": opt_s[OWNERS] / opt_s[ANCHOR],
        "opt_naive_ratio_vs_anchor": opt_s[NAIVE] / opt_s[ANCHOR],
        "exchange_bytes": result["bytes"],
        "bytes_as_predicted": all(
            r["counted_sent"] == r["predicted_sent"]
            and r["counted_received"] == r["predicted_received"]
            for r in result["bytes"]
        ),
        "imbalance": result["imbalance"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_repeat_arg(parser)
    parser.set_defaults(model="gpt")
    args = parser.parse_args()
    if args.model != "gpt":
        parser.error("this benchmark trains the GPT (--model gpt): Muon steps its blocks")
    args.world_size = args.world_size or 4
    args.steps = args.steps or (3 if args.quick else 10)
    args.warmup = 1 if args.quick else args.warmup
    fill_model_defaults(args)
    runs = run_repeats(lambda index: measure(args), args.repeat)
    finish(
        runs,
        ratio_keys=(
            "ratio_vs_anchor",
            "naive_ratio_vs_anchor",
            "opt_ratio_vs_anchor",
            "opt_naive_ratio_vs_anchor",
        ),
    )


if __name__ == "__main__":
    main()
