"""Train a small model with gradsync's DataParallel on synthetic data.

    torchrun --nproc_per_node 2 examples/torch_train.py                # CPU: gloo
    torchrun --nproc_per_node 8 examples/torch_train.py                # GPUs: NCCL, unchanged
    torchrun --nproc_per_node 2 examples/torch_train.py --legacy       # explicit sync mode
    torchrun --nproc_per_node 2 examples/torch_train.py --reduce-dtype bfloat16

A student MLP learns a fixed random teacher network; every rank draws its own batches. Each
optimizer step accumulates ``--accum`` micro-batches, all but the last under ``no_sync()``.
Rank 0 prints the configuration, shows a progress bar (stderr), logs the loss averaged over
ranks, and at the end writes the weights (safetensors, written atomically) and a small JSON
summary to ``--out``.

The baseline: torch's own ``DistributedDataParallel`` trains a copy of the same model on the
same batches beside it; the largest relative parameter difference between the two is printed
and, with float32 reductions, must stay under ``--tolerance``.

The end (``teardown`` below): training lives in a function, so the objects that hold the
process group (wrappers, optimizers) are gone when it returns; then ``dist.barrier()``,
``dist.destroy_process_group()`` and ``gc.collect()``. A gloo group still referenced at
interpreter shutdown keeps its worker threads alive into it, and the process can abort with
"terminate called without an active exception" after a successful run.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import time

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn
from torch.nn import functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from gradsync_torch import DataParallel


def mlp(width: int, depth: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(32, width), nn.GELU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
    return nn.Sequential(*layers, nn.Linear(width, 8))


def main() -> None:
    parser = argparse.ArgumentParser(description="gradsync DataParallel training example")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32, help="samples per micro-batch per rank")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--legacy", action="store_true", help="overlap=False + sync_gradients()")
    parser.add_argument("--reduce-dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--out", default="checkpoints/torch_train")
    parser.add_argument("--tolerance", type=float, default=1e-5, help="largest relative diff")
    args = parser.parse_args()

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    # Everything that holds a process group (the wrappers, the optimizers) lives in train()
    # and is gone when it returns, so teardown() can really end the process group.
    in_step, diff = train(args)
    teardown()
    if not in_step:
        raise SystemExit("replicas diverged")
    low_precision = args.reduce_dtype not in (None, "float32")
    if diff > args.tolerance and not low_precision:
        raise SystemExit(f"differs from torch DDP by {diff:.2e} (tolerance {args.tolerance})")


def train(args: argparse.Namespace) -> tuple[bool, float]:
    """Train; return whether the replicas agree and the largest difference from DDP."""
    use_cuda = torch.cuda.is_available()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))

    teacher = mlp(64, 2, seed=1234).to(device).requires_grad_(False)
    model = DataParallel(
        mlp(args.width, args.depth, seed=0).to(device),
        overlap=not args.legacy,
        reduce_dtype=getattr(torch, args.reduce_dtype) if args.reduce_dtype else None,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    # The baseline: torch's DDP on a copy of the same model, same optimizer, same batches.
    ddp = DistributedDataParallel(mlp(args.width, args.depth, seed=0).to(device))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr, weight_decay=0.01)
    ddp_sched = torch.optim.lr_scheduler.CosineAnnealingLR(ddp_opt, T_max=args.steps)
    gen = torch.Generator(device=device).manual_seed(10_000 + rank)  # own data per rank
    if rank == 0:
        print(
            f"config: {world_size} ranks ({dist.get_backend()}), {args.steps} steps of "
            f"{args.accum} x {args.batch} samples per rank, MLP width {args.width} depth "
            f"{args.depth}, AdamW lr {args.lr:g} cosine, "
            f"{'legacy sync' if args.legacy else 'overlapped'} reduction in "
            f"{args.reduce_dtype or 'the gradient dtype'}; baseline: torch DDP"
        )

    start = time.perf_counter()
    logged = torch.zeros(1, device=device)
    bar = tqdm(range(1, args.steps + 1), disable=rank != 0, desc="train", unit="step")
    for step in bar:
        for micro in range(args.accum):
            x = torch.randn(args.batch, 32, generator=gen, device=device)
            y = teacher(x)
            last = micro == args.accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                loss = F.mse_loss(model(x), y) / args.accum
                loss.backward()  # the last micro-batch's backward syncs the accumulated sum
            with contextlib.nullcontext() if last else ddp.no_sync():
                (F.mse_loss(ddp(x), y) / args.accum).backward()
            logged += loss.detach()
        model.sync_gradients()  # needed in legacy mode; a no-op in overlap mode
        for opt, sched in ((optimizer, scheduler), (ddp_opt, ddp_sched)):
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
        if step % args.log_every == 0 or step == args.steps:
            dist.all_reduce(logged)  # sum over ranks of the per-rank loss sums
            steps_logged = args.log_every if step % args.log_every == 0 else step % args.log_every
            mean_loss = logged.item() / world_size / steps_logged
            logged.zero_()
            bar.set_postfix(loss=f"{mean_loss:.4f}")
            if rank == 0:
                tqdm.write(
                    f"step {step:5d}  loss {mean_loss:.5f}  lr {scheduler.get_last_lr()[0]:.2e}"
                )

    # Every replica must hold the same weights: compare one checksum per rank.
    checksum = torch.stack([p.detach().double().sum() for p in model.parameters()]).sum()
    sums = [torch.zeros_like(checksum) for _ in range(world_size)]
    dist.all_gather(sums, checksum)
    in_step = all(torch.equal(s, sums[0]) for s in sums)
    diff = max(
        ((a - b).abs().max() / b.abs().max()).item()
        for a, b in zip(model.module.parameters(), ddp.module.parameters(), strict=True)
    )
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        weights = os.path.join(args.out, "model.safetensors")
        state = {k: v.detach().cpu().contiguous() for k, v in model.module.state_dict().items()}
        save_file(state, weights + ".tmp")
        os.replace(weights + ".tmp", weights)  # atomic: a crash never leaves half a file
        summary = {
            "steps": args.steps,
            "world_size": world_size,
            "final_loss": mean_loss,
            "replicas_identical": in_step,
            "param_diff_vs_ddp": diff,
            "bucket_plan_fingerprint": model.bucket_plan.fingerprint,
            "seconds": round(time.perf_counter() - start, 2),
        }
        with open(os.path.join(args.out, "summary.json.tmp"), "w") as f:
            json.dump(summary, f, indent=2)
        os.replace(
            os.path.join(args.out, "summary.json.tmp"), os.path.join(args.out, "summary.json")
        )
        print(f"replicas identical: {in_step}; checkpoint written to {weights}")
        print(f"largest relative parameter difference from torch DDP: {diff:.2e}")
    return in_step, diff


def teardown() -> None:
    """End the process group cleanly, after every object holding it is gone (``train``
    returned): wait for every rank (rank 0 may still be writing the checkpoint), destroy the
    groups, then collect the garbage cycles (modules with hooks) that still reference them.

    Only when its last reference goes does a gloo process group join its worker threads. If
    that waits for interpreter shutdown, a worker thread that touches Python then (releasing
    a finished work's tensors) is killed mid-C++ and the process aborts with "terminate
    called without an active exception", after a successful run. Destroying the group while
    the wrapper or optimizer still holds it leaves those threads alive just the same.
    """
    dist.barrier()
    dist.destroy_process_group()
    gc.collect()


if __name__ == "__main__":
    main()
