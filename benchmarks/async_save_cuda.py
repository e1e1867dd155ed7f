"""Saves that do not stop training, on a GPU: how long a save of device-memory state blocks
the training, blocking and ``blocking=False``, against DCP's ``async_save`` (issue 39's "on a
GPU when one is lent"; docs/checkpoints.md, "On a GPU").

The same state as ``async_save.py``: 24 x Linear(1024, 1024) with Adam (288 MiB), here on one
GPU in one process (NCCL, world size 1: NCCL refuses two ranks on one GPU), gradsync
``DataParallel`` + ZeRO-1 ``ZeroRedundancyOptimizer``. Every variant saves from the same
training loop, round by round:

    gradsync, blocking          opt.save(path, model=module)
    gradsync, blocking=False    opt.save(path, model=module, blocking=False)
    DCP async, thread/process   dcp.async_save of the same tensors (thread / process mode)

For each: the time the call blocks (after the GPU's work is done), and the steps that ran
while the write went on against a quiet step.

    python benchmarks/async_save_cuda.py            # needs a CUDA GPU
    python benchmarks/async_save_cuda.py --rounds 3

JAX on a GPU: ``cd benchmarks && JAX_PLATFORMS=cuda XLA_FLAGS= python _async_save_jax.py
'{"dir": "/tmp/js", "layers": 24, "width": 1024, "batch": 64, "warmup": 1, "rounds": 5,
"quiet_steps": 2, "during_steps": 6}'`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

VARIANTS = (
    "gradsync, blocking",
    "gradsync, blocking=False",
    "DCP async, thread",
    "DCP async, process",
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds (one warm-up first)")
    parser.add_argument("--during-steps", type=int, default=6, help="steps after each save")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("async_save_cuda.py measures saves of GPU memory: run it on a machine with CUDA")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    torch.manual_seed(0)
    layers = [m for _ in range(24) for m in (nn.Linear(1024, 1024), nn.ReLU())]
    module = nn.Sequential(*layers).to(device)
    model = DataParallel(module)
    opt = ZeroRedundancyOptimizer(module.named_parameters(), torch.optim.Adam, lr=1e-4)
    x = torch.randn(256, 1024, device=device)

    def step() -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    for _ in range(5):
        step()
    root = tempfile.mkdtemp()
    group = dist.new_group(backend="gloo")  # DCP's async agreement, as torchtitan gives it

    def dcp_state() -> dict[str, Any]:
        states = opt.optim.state.values()
        return {
            "model": module.state_dict(),
            "optim": {
                f"{i}/{k}": v
                for i, s in enumerate(states)
                for k, v in s.items()
                if torch.is_tensor(v) and v.dim() > 0
            },
        }

    rows: dict[str, list[tuple[float, float, list[float]]]] = {name: [] for name in VARIANTS}
    state_bytes = sum(p.numel() * p.element_size() * 3 for p in module.parameters())
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(0)}, "
        f"{state_bytes / 2**20:.0f} MiB of weights and Adam state on the GPU"
    )
    for r in range(1 + args.rounds):
        for name in VARIANTS:
            quiet = [step() for _ in range(3)]
            path = os.path.join(root, f"{VARIANTS.index(name)}-{r}")
            torch.cuda.synchronize()
            start = time.perf_counter()
            handle: Any = None
            if name == VARIANTS[0]:
                opt.save(path, model=module)
            elif name == VARIANTS[1]:
                handle = opt.save(path, model=module, blocking=False)
            else:
                kind = (
                    AsyncCheckpointerType.THREAD
                    if "thread" in name
                    else AsyncCheckpointerType.PROCESS
                )
                handle = dcp.async_save(
                    dcp_state(),
                    checkpoint_id=path,
                    process_group=group,
                    async_checkpointer_type=kind,
                )
            blocked = time.perf_counter() - start
            during = []
            for _ in range(args.during_steps):
                running = handle is not None and not handle.done()
                seconds = step()
                if running:
                    during.append(seconds)
            if handle is not None:
                handle.wait() if hasattr(handle, "wait") else handle.result()
            if r:  # the first round warms up
                rows[name].append((blocked, statistics.median(quiet), during))
    for name, measured in rows.items():
        blocked = [row[0] for row in measured]
        quiet = statistics.median(row[1] for row in measured)
        during = [s for row in measured for s in row[2]]
        slowdown = f"{statistics.median(during) / quiet:.2f}x" if during else "-"
        print(
            f"{name:26s} blocked {statistics.median(blocked) * 1e3:8.1f} ms "
            f"[{min(blocked) * 1e3:.1f}-{max(blocked) * 1e3:.1f}]   steps during the write "
            f"{slowdown} ({len(during)} steps, quiet {quiet * 1e3:.2f} ms)"
        )
    blocked_of = {name: statistics.median(row[0] for row in rows[name]) for name in VARIANTS}
    mine = blocked_of[VARIANTS[1]]
    print(
        f"blocking=False blocks {mine / blocked_of[VARIANTS[0]]:.3f}x the blocking save, "
        f"{mine / blocked_of[VARIANTS[2]]:.3f}x / {mine / blocked_of[VARIANTS[3]]:.3f}x DCP "
        "async_save's (thread / process)"
    )
    shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
