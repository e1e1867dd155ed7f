"""gradsync's ZeRO-3 memory estimate against what FSDP2 (or gradsync) holds, per rank, on gloo.

Builds the benchmarks' GPT (``--model gpt``, tied head), applies torch's ``fully_shard``
(``--impl gradsync``: gradsync's) per block and on the root, runs one AdamW step, then
measures on every rank:

- parameters: the padded sharded storage (FSDP2's ``FSDPParam._sharded_param_data``,
  gradsync's ``ShardedParameter.padded``);
- gradients: the distinct storages behind the sharded ``param.grad`` after backward;
- optimizer state: AdamW's ``exp_avg`` and ``exp_avg_sq`` local tensors;
- peak: parameters + state + the largest rise of live CPU bytes during the next step
  (torch's profiler with ``profile_memory``), so it includes the step's activations: run with
  a small batch (the default here) to see model states.

and prints them beside ``estimate_zero3`` (docs/design.md §16). The target is a prediction
within 10 % of the measurement. Run: ``python benchmarks/zero3_memory.py --world-size 2``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _spawn import spawn_ranks
from _torch_models import build_model, fill_model_defaults, loss_of, make_batch

from gradsync_core import block_prefixes, estimate_zero3, plan_param_shards
from gradsync_torch import param_specs


def peak_live_bytes(prof: Any) -> int:
    """The largest rise of live CPU bytes over the profiled region, from its memory events."""
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    live = peak = 0
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == torch.autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    return peak


def _tied_names(model: torch.nn.Module) -> list[str]:
    """The listed name of every parameter that two modules share (a tied weight)."""
    first: dict[int, str] = {}
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first and first[id(param)] not in tied:
            tied.append(first[id(param)])
        first.setdefault(id(param), name)
    return tied


def _sharded_param_bytes(model: torch.nn.Module) -> int:
    """The padded sharded parameter storage: FSDP2's ``_sharded_param_data``, or gradsync's
    ``ShardedParameter.padded``."""
    total = 0
    for module in model.modules():
        unit = getattr(module, "_gradsync_shard_unit", None)
        if unit is not None:
            total += sum(p.padded.nbytes for p in unit.params.params)
        elif hasattr(module, "_get_fsdp_state"):
            group = module._get_fsdp_state()._fsdp_param_group
            total += sum(fp._sharded_param_data.nbytes for fp in group.fsdp_params) if group else 0
    return total


def _measure(model: torch.nn.Module, opt: torch.optim.Optimizer, batch: Any) -> dict[str, int]:
    from torch.profiler import ProfilerActivity, profile

    def step() -> None:
        opt.zero_grad()
        loss_of(model, *batch).backward()
        opt.step()

    step()  # creates the optimizer state
    params = _sharded_param_bytes(model)
    state = sum(
        value.to_local().nbytes
        for per_param in opt.state.values()
        for key, value in per_param.items()
        if key != "step"
    )
    opt.zero_grad()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss_of(model, *batch).backward()
        storages = {
            p.grad.to_local().untyped_storage().data_ptr(): p.grad.to_local().untyped_storage()
            for p in model.parameters()
            if p.grad is not None
        }
        opt.step()
    grads = sum(s.nbytes() for s in storages.values())
    return {
        "params": params,
        "grads": grads,
        "state": state,
        "peak": params + state + peak_live_bytes(prof),
    }


def worker(rank: int, world_size: int, store_path: str, args: argparse.Namespace, out: Any) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    if args.impl == "gradsync":
        from gradsync_torch import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, world_size), rank=rank, world_size=world_size
    )
    try:
        model = build_model(args)
        if args.untie:  # the head gets a weight of its own: no gradient accumulation
            model.head.weight = torch.nn.Parameter(model.head.weight.detach().clone())
        specs = param_specs(model)
        tied = _tied_names(model)
        plan = plan_param_shards(specs, world_size=world_size, units=block_prefixes(specs))
        mesh = init_device_mesh("cpu", (world_size,))
        modules = dict(model.named_modules())
        for unit in plan.units[1:]:
            fully_shard(modules[unit.prefix], mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        measured = _measure(model, opt, make_batch(args, rank, torch.device("cpu")))
        predicted = estimate_zero3(plan, optimizer="adamw", tied=tied).ranks[rank].to_json()
        rows = [None] * world_size
        dist.all_gather_object(rows, {"rank": rank, "measured": measured, "predicted": predicted})
        if rank == 0:
            out.put(rows)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=1, help="small: the peak includes activations")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--heads", type=int, default=None)
    parser.add_argument("--untie", action="store_true", help="give the head its own weight")
    parser.add_argument(
        "--impl", choices=("fsdp2", "gradsync"), default="fsdp2", help="whose fully_shard"
    )
    args = parser.parse_args()
    args.model = "gpt"
    fill_model_defaults(args)
    rows = spawn_ranks(worker, args)
    keys = [
        ("params", "parameter_bytes"),
        ("grads", "gradient_bytes"),
        ("state", "optimizer_state_bytes"),
        ("peak", "peak_bytes"),
    ]
    head = " (untied head)" if args.untie else ""
    print(
        f"{args.impl}: GPT {args.layers} x {args.width}{head}, vocab {args.vocab}, batch "
        f"{args.batch} x seq {args.seq}, {args.world_size} gloo ranks, AdamW; bytes measured / "
        "predicted"
    )
    for row in rows:
        cells = []
        for mine, theirs in keys:
            m, p = row["measured"][mine], row["predicted"][theirs]
            cells.append(f"{mine} {m:,} / {p:,} ({p / m - 1:+.1%})")
        print(f"rank {row['rank']}: " + "; ".join(cells))
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
