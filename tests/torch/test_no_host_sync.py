"""No host-device synchronization in a DataParallel training step (docs/torch-data-parallel.md).

On a GPU the Python thread that runs the autograd hooks also launches the backward kernels;
one read of a device value on the host stalls it until the GPU catches up, and the step loses
its overlap. Two tests keep that honest:

- CPU (always runs): 2 gloo ranks, every mode (overlap, legacy, gradient_as_bucket_view,
  no_sync, a parameter only some ranks use), with ``Tensor.item`` / ``tolist`` / ``cpu`` /
  ``numpy`` / ``__bool__`` / ``to`` / ``cuda`` wrapped so that every call made from gradsync's
  own code during a step is recorded. After a warm-up step (the one-time rebuild) no step may
  make one, except reads of the CPU used-map: on every rank the runtime agreement ints at its
  end, once per sync, and on a rank that lacked a gradient the used flags, once per sync. Both
  are CPU tensors reduced over gloo, so neither waits for the accelerator.
- GPU (marked ``gpu``, skipped without CUDA): world size 1 on NCCL, the same modes, under
  ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronizing CUDA call.
"""

from __future__ import annotations

import copy
import os
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

import gradsync_torch as gt
from tests.support.harness import run_workers

# Tensor methods that read a device value on the host, or copy host memory to the device.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "to", "cuda")
PACKAGE_DIR = os.path.dirname(gt.__file__)


class Branchy(nn.Module):
    """``sometimes`` gets a gradient only on ranks whose forward passes ``use=True``."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(width, width)
        self.sometimes = nn.Linear(width, width)
        self.tail = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor, use: bool = True) -> torch.Tensor:
        h = torch.tanh(self.body(x))
        if use:
            h = h + self.sometimes(x)
        return self.tail(h)


def _called_from_gradsync() -> str | None:
    """The first gradsync frame on the stack (file:line), or None."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.startswith(PACKAGE_DIR):
            return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


@contextmanager
def recording_host_reads() -> Iterator[list[tuple[str, str]]]:
    """Record (method, gradsync file:line) of every HOST_READS call made from gradsync."""
    calls: list[tuple[str, str]] = []
    originals = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def recorded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            where = _called_from_gradsync()
            if where is not None:
                calls.append((name, where))
            return original(self, *args, **kwargs)

        return recorded

    try:
        for name, original in originals.items():
            setattr(torch.Tensor, name, wrap(name, original))
        yield calls
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def train_steps(models: dict[str, gt.DataParallel], steps: int, rank: int, device: str) -> None:
    """``steps`` training steps of every model: each is one (or, for no_sync, two) backward,
    the sync and an SGD step; only rank 0 uses ``sometimes`` in the ``unused`` model."""
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(4, 8, generator=gen).to(device)
        y = torch.randn(4, 2, generator=gen).to(device)
        for name, model in models.items():
            model.zero_grad(set_to_none=True)
            if name == "no_sync":
                with model.no_sync():
                    F.mse_loss(model(x), y).backward()
            use = rank == 0 if name == "unused" else True
            F.mse_loss(model(x, use), y).backward()
            if not model.options.overlap:
                model.sync_gradients()
            with torch.no_grad():
                for p in model.parameters():
                    if p.grad is not None:
                        p.sub_(0.1 * p.grad)


def build_models(device: str) -> dict[str, gt.DataParallel]:
    base = Branchy().to(device)
    return {
        "overlap": gt.DataParallel(copy.deepcopy(base), bucket_cap_mb=0.0005),
        "legacy": gt.DataParallel(copy.deepcopy(base), overlap=False),
        "view": gt.DataParallel(copy.deepcopy(base), gradient_as_bucket_view=True),
        "no_sync": gt.DataParallel(copy.deepcopy(base)),
        "unused": gt.DataParallel(copy.deepcopy(base)),
    }


def record_steps(rank: int, world_size: int) -> dict[str, list[tuple[str, str]]]:
    """Per model, the host reads gradsync made in 3 steps after a warm-up step."""
    models = build_models("cpu")
    train_steps(models, 1, rank, "cpu")  # the one-time rebuild broadcast happens here
    recorded = {}
    for name, model in models.items():
        with recording_host_reads() as calls:
            train_steps({name: model}, 3, rank, "cpu")
        recorded[name] = calls
    return recorded


def test_no_host_reads_in_a_step_on_cpu() -> None:
    for rank, recorded in enumerate(run_workers(record_steps, 2)):
        for name, calls in recorded.items():
            lacked = name == "unused" and rank != 0
            # Every rank reads the agreement ints of the CPU used-map once per sync.
            agreement = [c for c in calls if c[0] == "tolist" and c[1].startswith("used_map.py")]
            flags = [c for c in calls if lacked and c[0] == "tolist" and c not in agreement]
            assert len(agreement) == 3, f"rank {rank}, {name}: agreement reads {agreement}"
            if lacked:  # the used flags are read exactly once per step there, from the CPU
                assert len(flags) == 3, f"rank {rank}: used-map reads {flags}"
            others = [c for c in calls if c not in agreement and c not in flags]
            assert not others, f"rank {rank}, {name}: host reads {others}"


def _gpu_worker(store_path: str) -> None:
    torch.cuda.set_device(0)
    device = torch.device("cuda", 0)
    store = dist.FileStore(store_path, 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=device)
    try:
        models = build_models("cuda")
        train_steps(models, 1, 0, "cuda")  # warm-up: rebuild, lazy CUDA initialisation
        batches = [(torch.randn(4, 8, device=device), torch.randn(4, 2, device=device))]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(3):
                for name, model in models.items():
                    x, y = batches[0]
                    model.zero_grad(set_to_none=True)
                    if name == "no_sync":
                        with model.no_sync():
                            F.mse_loss(model(x), y).backward()
                    F.mse_loss(model(x, name != "unused"), y).backward()
                    if not model.options.overlap:
                        model.sync_gradients()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert models["unused"].module.sometimes.weight.grad is None
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_no_host_device_sync_on_gpu() -> None:
    ctx = torch.multiprocessing.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        proc = ctx.Process(target=_gpu_worker, args=(os.path.join(tmp, "store"),))
        proc.start()
        proc.join(timeout=300)
        assert proc.exitcode == 0, f"the NCCL worker exited with {proc.exitcode} (see stderr)"
