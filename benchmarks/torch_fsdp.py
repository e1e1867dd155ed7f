"""Sharding step time and memory: DDP, torch FSDP2, gradsync ZeRO-1, ZeRO-2 and ZeRO-3.

docs/design.md §11: every variant runs in the same process tree, alternating step by step (the
order rotates every round), on the same model and data; each time is the median over the timed
rounds of the slowest rank's step. A step is zero_grad(set_to_none=True), forward, loss,
backward and AdamW's step.

    DDP                 torch DistributedDataParallel, plain AdamW (every rank holds all)
    FSDP2               torch.distributed.fsdp.fully_shard per block and on the root
    gradsync ZeRO-1     gradsync DataParallel + ZeroRedundancyOptimizer(AdamW): state 1/N
    gradsync ZeRO-2     the same with shard_gradients=True: gradients reduce-scattered, 1/N
    gradsync ZeRO-3     gradsync_torch.fully_shard, FSDP2's units

    python benchmarks/torch_fsdp.py --repeat 3               # GPT 4 x 256, 2 gloo ranks
    python benchmarks/torch_fsdp.py --world-size 4 --quick

Memory, per rank, after the timed rounds: the resident bytes of parameters (the distinct
storages behind them: FSDP2's and gradsync's padded shards, the others' full tensors),
gradients (after a backward: ``param.grad`` and gradsync ``DataParallel``'s bucket buffers or
ZeRO-2 shards, each storage once) and AdamW state, and the **peak** of one more step:
resident parameters and state plus the largest rise of live CPU bytes during the step
(torch's profiler, ``profile_memory=True``), so it includes activations and the gathered
units. The model is the
benchmarks' GPT (``--model gpt``, tied head; benchmarks/_torch_models.py).

The last line is one JSON object: {"bench": "torch_fsdp", "ratio_vs_anchor": gradsync ZeRO-3's
step time over FSDP2's, "ddp_ratio_vs_anchor", "zero1_ratio_vs_anchor",
"zero2_ratio_vs_anchor": the others' over FSDP2's, ...}; the anchor is FSDP2.
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
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import add_repeat_arg, finish, run_repeats
from _spawn import spawn_ranks
from _torch_models import (
    add_common_args,
    build_model,
    count_params,
    describe,
    fill_model_defaults,
    loss_of,
    make_batch,
)
from zero3_memory import peak_live_bytes

from gradsync_core import block_prefixes
from gradsync_torch import DataParallel, ZeroRedundancyOptimizer, fully_shard, param_specs

ZERO1, ZERO2, ZERO3 = "gradsync ZeRO-1", "gradsync ZeRO-2", "gradsync ZeRO-3"
VARIANTS = ("DDP", "FSDP2", ZERO1, ZERO2, ZERO3)
ANCHOR = "FSDP2"
MIB = 1024 * 1024


def _storage_nbytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (DTensors: their local pieces)."""
    storages = {}
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        storage = local.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _sharded(shard: Any, model: nn.Module) -> nn.Module:
    modules = dict(model.named_modules())
    for prefix in block_prefixes(param_specs(model)):  # one unit per block, then the root
        shard(modules[prefix])
    shard(model)
    return model


def _setup(name: str, args: argparse.Namespace) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.fsdp import fully_shard as fsdp2

    model = build_model(args)
    if name in (ZERO1, ZERO2):
        wrapped = DataParallel(model, shard_gradients=name == ZERO2)
        opt = ZeroRedundancyOptimizer(
            model.named_parameters(),
            torch.optim.AdamW,
            lr=1e-4,
            shard_gradients=name == ZERO2,
            data_parallel=wrapped if name == ZERO2 else None,  # it steps the wrapper's shards
        )
        return wrapped, opt
    if name == "DDP":
        model = DistributedDataParallel(model)
    else:
        model = _sharded(fsdp2 if name == "FSDP2" else fully_shard, model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def _grad_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor holding gradients now: ``param.grad`` and gradsync's bucket buffers or
    ZeRO-2 gradient shards."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if isinstance(model, DataParallel):
        grads += list(model.reducer.buffer_tensors())
    return grads


def _memory(model: nn.Module, opt: torch.optim.Optimizer, batch: Any) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    opt.zero_grad()
    loss_of(model, *batch).backward()
    grads = _storage_nbytes(_grad_tensors(model))
    opt.zero_grad()
    params = _storage_nbytes(list(model.parameters()))
    inner = getattr(opt, "optim", opt)  # gradsync's ZeRO keeps a local optimizer there
    state = _storage_nbytes(
        [v for s in inner.state.values() for k, v in s.items() if k != "step" and v.dim() > 0]
    )
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_of(model, *batch).backward()
        opt.step()
    opt.zero_grad()
    return {
        "params": params,
        "grads": grads,
        "state": state,
        "peak": params + state + peak_live_bytes(prof),
    }


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any):
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        setups = {name: _setup(name, args) for name in VARIANTS}
        models = {name: model for name, (model, _) in setups.items()}
        opts = {name: opt for name, (_, opt) in setups.items()}
        batch = make_batch(args, rank, torch.device("cpu"))

        def step(name: str) -> None:
            opts[name].zero_grad(set_to_none=True)
            loss_of(models[name], *batch).backward()
            opts[name].step()

        times: dict[str, list[float]] = {name: [] for name in VARIANTS}
        for r in range(args.warmup + args.steps):
            order = VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]
            for name in order:
                dist.barrier()
                start = time.perf_counter()
                step(name)
                elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the slowest rank's step
                if r >= args.warmup:
                    times[name].append(float(elapsed))
        memory = {name: _memory(models[name], opts[name], batch) for name in VARIANTS}
        rows: list[Any] = [None] * world_size
        dist.all_gather_object(rows, memory)
        if rank == 0:
            out.put(
                {
                    "step_s": {n: statistics.median(t) for n, t in times.items()},
                    "memory": rows,
                    "params": count_params(build_model(args)),
                }
            )
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One whole run: spawn the ranks, print the table, return the figures."""
    result = spawn_ranks(worker, args)
    step_s = result["step_s"]
    print(f"{describe(args, result['params'])}, {args.world_size} gloo ranks, AdamW")
    print(f"{'variant':<18}{'step ms':>9}{'vs FSDP2':>10}   per rank MiB: params/grads/state/peak")
    for name in VARIANTS:
        per_rank = "  ".join(
            "/".join(f"{row[name][k] / MIB:.1f}" for k in ("params", "grads", "state", "peak"))
            for row in result["memory"]
        )
        ratio = step_s[name] / step_s[ANCHOR]
        print(f"{name:<18}{step_s[name] * 1e3:>9.1f}{ratio:>9.3f}x   {per_rank}")
    return {
        "bench": "torch_fsdp",
        "world_size": args.world_size,
        "step_s": step_s[ZERO3],
        "anchor_step_s": step_s[ANCHOR],
        "ddp_step_s": step_s["DDP"],
        "ratio_vs_anchor": step_s[ZERO3] / step_s[ANCHOR],
        "ddp_ratio_vs_anchor": step_s["DDP"] / step_s[ANCHOR],
        "zero1_ratio_vs_anchor": step_s[ZERO1] / step_s[ANCHOR],
        "zero2_ratio_vs_anchor": step_s[ZERO2] / step_s[ANCHOR],
        "peak_bytes": {n: [row[n]["peak"] for row in result["memory"]] for n in VARIANTS},
        "resident_bytes": {
            n: [row[n]["params"] + row[n]["grads"] + row[n]["state"] for row in result["memory"]]
            for n in VARIANTS
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_args(parser)
    add_repeat_arg(parser)
    parser.set_defaults(model="gpt")
    args = parser.parse_args()
    args.world_size = args.world_size or 2
    args.steps = args.steps or (4 if args.quick else 10)
    args.warmup = 1 if args.quick else args.warmup
    fill_model_defaults(args)
    runs = run_repeats(lambda index: measure(args), args.repeat)
    finish(
        runs,
        ratio_keys=(
            "ratio_vs_anchor",
            "ddp_ratio_vs_anchor",
            "zero1_ratio_vs_anchor",
            "zero2_ratio_vs_anchor",
        ),
    )


if __name__ == "__main__":
    main()
