"""Tensor + context (+ data) parallel training on CPU, checked against a serial model.

    torchrun --nproc_per_node 4 examples/torch_tp_train.py                      # tp=2 x cp=2
    torchrun --nproc_per_node 4 examples/torch_tp_train.py --cp 1               # tp=2 x dp=2
    torchrun --nproc_per_node 4 examples/torch_tp_train.py --sequence-parallel
    torchrun --nproc_per_node 4 examples/torch_tp_train.py --skip-shared-sums  # drifts, exit 1

Every rank also trains the serial model on the full batch (it is tiny) and the script
prints how far the parallel parameters drift from it. ``DataParallel(model, groups=groups)``
averages over ``dp`` and adds the extra gradient sums over ``cp`` (and ``tp`` under sequence
parallelism), derived from the layers: nothing is marked, nothing is called by hand.
``--skip-shared-sums`` builds the wrapper with an empty plan instead. The last line is one
JSON object.
"""

from __future__ import annotations

import argparse
import gc
import json
import os

import torch
import torch.distributed as dist
from tp_models import MLPTransformer, ParallelMLPTransformer  # beside this script

from gradsync_core import ReductionPlan, Topology, split_shapes
from gradsync_torch import (
    DataParallel,
    ProcessGroups,
    local_state,
)


def local_tokens(t: torch.Tensor, topo: Topology, rank: int, sp: bool) -> torch.Tensor:
    """This rank's tokens: its dp rows, its cp chunk of the sequence, its tp chunk of that."""
    c = topo.coordinates(rank)
    t = t.split(list(split_shapes(t.shape[0], topo.dp)), 0)[c["dp"]]
    t = t.split(list(split_shapes(t.shape[1], topo.cp)), 1)[c["cp"]]
    if sp:
        t = t.split(list(split_shapes(t.shape[1], topo.tp)), 1)[c["tp"]]
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--cp", type=int, default=2)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=90)  # uneven over tp=4: [23, 23, 23, 21]
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=30, help="tokens per sample (split over cp)")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument(
        "--skip-shared-sums",
        action="store_true",
        help="leave out the derived model-parallel sums, to watch the model drift",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    # What holds process groups (ProcessGroups, the wrapper) lives in train() and is gone
    # when it returns; only then does ending the process group join gloo's threads.
    drift = train(args)
    dist.barrier()  # every rank is done with every collective
    dist.destroy_process_group()
    gc.collect()  # modules with hooks are cycles: free them now, not at interpreter exit
    if drift > 1e-4:
        raise SystemExit(f"parallel training drifted from the serial model by {drift}")


def train(args: argparse.Namespace) -> float:
    """Train beside the serial model; return the largest parameter drift from it."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))
    rank, world = dist.get_rank(), dist.get_world_size()
    topo = Topology.create(world, tp=args.tp, cp=args.cp)
    groups = ProcessGroups(topo)
    sp = args.sequence_parallel

    torch.manual_seed(0)  # the same serial model on every rank
    serial = MLPTransformer(args.dim, args.hidden, args.depth)
    model = ParallelMLPTransformer.from_serial(serial, groups, sequence_parallel=sp)
    # The dp mean (over groups["dp"]) during backward, then the derived model-parallel sums.
    # The control leaves them out with an empty plan.
    empty = ReductionPlan(topology=topo, reductions=()) if args.skip_shared_sums else None
    wrapped = DataParallel(model, groups=groups, shared_plan=empty)
    plan = wrapped.shared_plan
    dp = groups.group("dp")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    serial_opt = torch.optim.AdamW(serial.parameters(), lr=args.lr)
    # The loss is summed over the axes that split the tokens, then averaged over dp.
    loss_group = groups.group("-".join(model.gradsync_data_axes))

    if rank == 0:
        print(f"config: {world} ranks, topology {topo.order}: tp={topo.tp} cp={topo.cp} "
              f"dp={topo.dp}, sp={sp}; {args.steps} steps, batch {args.batch} x {args.seq} "
              f"tokens, dim {args.dim} hidden {args.hidden} depth {args.depth}, AdamW lr "
              f"{args.lr:g}; baseline: the serial model on the full batch")  # fmt: skip
        for r in plan.reductions:
            print(f"  extra sum over {r.group!r}: {len(r.names)} parameters, e.g. {r.names[:3]}")
        print(f"{'step':>4} {'loss':>10} {'serial loss':>12}")
    gen = torch.Generator().manual_seed(1)
    for step in range(args.steps):
        x = torch.randn(args.batch, args.seq, args.dim, generator=gen)
        target = torch.tanh(x.flip(-1))  # something learnable
        tokens = args.batch // topo.dp * args.seq  # this replica's tokens
        y = wrapped(local_tokens(x, topo, rank, sp))
        t = local_tokens(target, topo, rank, sp)
        share = ((y - t) ** 2).sum() / (
            tokens * args.dim
        )  # this rank's share of its replica's loss
        opt.zero_grad()
        share.backward()  # the dp mean and the model-parallel sums are done when this returns
        opt.step()

        serial_opt.zero_grad()
        serial_loss = ((serial(x) - target) ** 2).mean()
        serial_loss.backward()
        serial_opt.step()

        loss = share.detach().clone()
        if loss_group.size > 1:
            dist.all_reduce(loss, group=loss_group.process_group)
        if dp.size > 1:
            dist.all_reduce(loss, group=dp.process_group)
            loss /= dp.size
        if rank == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"{step:>4} {loss.item():>10.5f} {serial_loss.item():>12.5f}")

    expected = local_state(model, dict(serial.named_parameters()))
    drift = torch.tensor(
        max((p - expected[n]).abs().max().item() for n, p in model.named_parameters())
    )
    dist.all_reduce(drift, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max |parallel - serial| over every parameter shard: {drift.item():.2e}")
        summary = {
            "example": "torch_tp_train",
            "world_size": world,
            "tp": topo.tp,
            "cp": topo.cp,
            "dp": topo.dp,
            "sequence_parallel": sp,
            "reduction_groups": list(plan.group_names),
            "final_loss": round(loss.item(), 6),
            "serial_final_loss": round(serial_loss.item(), 6),
            "max_param_drift": drift.item(),
        }
        print(json.dumps(summary))
    return drift.item()


if __name__ == "__main__":
    main()
