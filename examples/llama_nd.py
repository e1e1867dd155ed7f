"""Every parallelism at once on the Llama reference, checked against one process.

    torchrun --nproc_per_node 8 examples/llama_nd.py --dp-shard 2 --tp 2 --pp 2
    torchrun --nproc_per_node 8 examples/llama_nd.py --dp-replicate 2 --dp-shard 2 --tp 2
    torchrun --nproc_per_node 8 examples/llama_nd.py --tp 2 --cp 2 --dp-shard 2
    torchrun --nproc_per_node 8 examples/llama_nd.py --ep 2 --dp-shard 4 --pp 2 --moe

    # save under one layout, resume under another (any dp, tp, cp, ep, pp size or schedule)
    torchrun --nproc_per_node 8 examples/llama_nd.py --dp-shard 2 --tp 2 --pp 2 --save /tmp/ckpt
    torchrun --nproc_per_node 8 examples/llama_nd.py --dp-shard 2 --tp 2 --cp 2 --resume /tmp/ckpt
    torchrun --nproc_per_node 4 examples/llama_nd.py --pp 4 --schedule GPipe --resume /tmp/ckpt

The axis sizes multiply to the world size as torchtitan's ``ParallelDims``:
``dp_replicate * dp_shard * cp * tp * pp``; ``ep`` is carved out of the data-parallel ranks
(Megatron-core's expert layout, ``gradsync_core.Topology``). Every rank also trains the
single-process model on the whole batch (it is tiny) and the script prints both losses and
the largest parameter difference. Before training, rank 0 prints what ``gradsync plan``
predicts for each rank's model state on this layout (the built-in ``llama-nd`` and
``llama-nd-moe`` are this script's models). ``--save DIR`` writes a checkpoint after training
(``gradsync_torch.checkpoint.save_boxes``: model space, the layout recorded in its manifest);
``--resume DIR`` loads one saved under any layout (``load_boxes``) and continues from its step,
the single-process model loading it too (``load_model_weights``,
``load_optimizer_state_dict``), so the comparison still holds. The last line is one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: the repo root

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, lm_loss_share, local_state, parallelize
from gradsync_core import Topology
from gradsync_core.checkpoint import describe_layout
from gradsync_torch import (
    load_boxes,
    load_model_weights,
    load_optimizer_state_dict,
    save_boxes,
)


def predicted_memory(args: argparse.Namespace, world: int) -> str:
    """``gradsync plan``'s per-rank bytes for this script's model on this layout."""
    command = [sys.executable, "-m", "gradsync_core", "plan"]
    command += ["--model", "llama-nd-moe" if args.moe else "llama-nd", "--world-size", str(world)]
    for axis in ("dp-shard", "tp", "cp", "pp", "ep"):
        command += [f"--{axis}", str(getattr(args, axis.replace("-", "_")))]
    command += ["--zero", "3", "--optimizer", "adamw"]
    command += ["--dtype", "float64" if args.float64 else "float32"]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode:
        return f"gradsync plan: {done.stderr.strip()}\n"
    return "predicted by `" + " ".join(["gradsync", *command[3:]]) + "`:\n" + done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ("dp-shard", "dp-replicate", "tp", "cp", "pp", "ep"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--moe", action="store_true", help="the mixture-of-experts variant")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8, help="global batch (split over dp)")
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--max-norm", type=float, default=0.5)
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint here after training")
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from a checkpoint saved under any layout"
    )
    parser.add_argument(
        "--float64",
        action="store_true",
        help="train in float64: the difference from one process drops to the sums' rounding "
        "(in float32 Adam magnifies it on near-zero gradients to ~1e-4)",
    )
    args = parser.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dp = args.dp_replicate * args.dp_shard
    if dp * args.tp * args.cp * args.pp != world:
        raise SystemExit(
            f"dp_replicate*dp_shard*tp*cp*pp = {dp * args.tp * args.cp * args.pp} but "
            f"{world} processes; pick sizes whose product is --nproc_per_node"
        )
    topology = Topology.create(
        world, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, dp_shard=args.dp_shard
    )
    config = LlamaConfig(
        vocab_size=64,
        dim=32,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        ffn_dim=32 if args.moe else 64,
        n_experts=4 if args.moe else 0,
    )
    options = ParallelOptions(
        microbatches=args.microbatches,
        schedule=args.schedule,
        sequence_parallel=not args.no_sequence_parallel,
    )
    dtype = torch.float64 if args.float64 else torch.float32
    model = parallelize(Llama(config).to(dtype), topology, options, seq_len=args.seq)
    if rank == 0:
        print("config:", json.dumps({"topology": topology.to_json(), "options": vars(args)}))
        print("mesh (slowest first):", topology.mesh_sizes())
        if topology.has_experts:
            print("expert mesh:", topology.mesh_sizes(expert=True))
        print("shared-gradient sums:", [p.group_names for p in model.shared])
        if model.pipeline is not None:
            plan = model.pipeline.plan
            print(f"pipeline: {plan.schedule}, {plan.microbatches} microbatches, {plan.layout}")
        print("fully_shard:", "HSDP" if topology.hsdp else "FSDP", f"over dp={topology.dp}")
        print(predicted_memory(args, world), end="", flush=True)

    reference = Llama(config).to(dtype)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1)
    opt = torch.optim.AdamW(list(model.parameters()), lr=args.lr, weight_decay=0.1)
    first = 0
    if args.resume:
        manifest = load_boxes(args.resume, model.held(), opt, specs=model.specs())
        load_model_weights(args.resume, reference)  # one process reads it too
        load_optimizer_state_dict(args.resume, ref_opt, reference)
        first = manifest.step
        if rank == 0:
            layout = describe_layout(manifest.extra.get("layout"))
            print(f"resumed {args.resume} at step {first}; it was saved under: {layout}")
    gen = torch.Generator().manual_seed(7)
    for _ in range(first):  # the batches the saved run already trained on
        torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
    groups = model.groups
    counts = model.has_last_stage and (options.sequence_parallel or groups.group_rank("tp") == 0)
    for step in range(first, first + args.steps):
        data = torch.randint(0, config.vocab_size, (args.batch, args.seq + 1), generator=gen)
        tokens, targets = data[:, :-1], data[:, 1:]
        loss = model.step(tokens, targets)
        model.clip_grad_norm_(args.max_norm)
        opt.step()
        opt.zero_grad()
        total = torch.zeros(1, dtype=dtype)
        if loss is not None and counts:
            total = loss.reshape(1).clone()
        dist.all_reduce(total)  # shares over cp (and tp) add up; replicas average over dp
        ref_loss = lm_loss_share(reference(tokens), targets, targets.numel())
        ref_loss.backward()
        ref_loss = ref_loss.detach()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), args.max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        if rank == 0:
            print(
                f"step {step}: loss {float(total) / topology.dp:.6f} "
                f"single process {float(ref_loss):.6f}"
            )
    worst = 0.0
    full = {n: p.detach() for n, p in reference.named_parameters(remove_duplicate=False)}
    for part in model.parts:
        want = local_state(part, full)
        for name, param in part.named_parameters():
            value = param.full_tensor() if isinstance(param, DTensor) else param
            worst = max(worst, float((value.detach() - want[name]).abs().max()))
    if args.save:
        save_boxes(args.save, model.held(), opt, specs=model.specs(), layout=model.layout())
        if rank == 0:
            print(f"saved {args.save}: resume under any layout with --resume {args.save}")
    every = torch.tensor([worst], dtype=torch.float64)
    dist.all_reduce(every, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max parameter difference vs single process: {float(every):.3e}")
        print(json.dumps({"max_param_diff": float(every), "world_size": world}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
