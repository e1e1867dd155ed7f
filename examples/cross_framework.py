"""Train in torch, continue in JAX from the same checkpoint: one training state, two frameworks.

    python examples/cross_framework.py                 # CPU only: 2 gloo ranks, 8 JAX devices
    python examples/cross_framework.py --steps 10 --plot curves.png
    python examples/cross_framework.py --b2 0.999       # Adam's default second-moment decay

1. torch: 2 ranks (spawned here with gloo, no torchrun needed) train an MLP with
   ``DataParallel`` + ``ZeroRedundancyOptimizer(AdamW)`` for ``2 * --steps`` steps on batches a
   ``ResumableSampler`` draws, and save the weights, optimizer state and data position after
   ``--steps`` (``opt.save(path, model=net, data=sampler)``).
2. JAX: 8 CPU devices load that checkpoint (``load_params`` + ``load_optimizer_state`` into
   ``shard_optimizer(optax.adamw)``, the position into a ``ResumableSampler``) and train
   the second half with ``data_parallel_step`` on the batches that sampler draws: the same
   samples the torch run read after its save.
3. Both loss curves are printed side by side: the JAX half continues the torch run, so its
   losses are torch's own up to float32 rounding. With matplotlib installed, ``--plot`` also
   writes a figure.

Adam's second-moment decay is ``--b2`` (default 0.99 here). Optax computes the bias correction
``1 - b2**t`` in float32 and torch in float64; with torch's default 0.999 that rounding is 14
times larger relative to ``1 - b2**t``, and the continuation's losses differ from torch's by
more (measured: 7.9e-7 at 0.99, 5.3e-6 at 0.999, 20 steps each side).
"""

from __future__ import annotations

import argparse
import itertools
import os
import tempfile
from typing import Any

import numpy as np

# 8 fake CPU devices; must be set before JAX is imported (it is imported in continue_in_jax).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

WIDTHS = [16] + [32] * 11 + [4]  # 12 Linear layers
HYPER = {"lr": 3e-3, "eps": 1e-8, "weight_decay": 0.01}
B1 = 0.9
RANKS, DEVICES, BATCH = 2, 8, 64
SAMPLES, SEED = 8 * BATCH + 10, 1234  # 8 global batches an epoch; the last 10 are dropped


def dataset() -> tuple[np.ndarray, np.ndarray]:
    """A fixed teacher's regression task, the same in both frameworks."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, WIDTHS[0])).astype(np.float32)
    teacher = rng.normal(size=(WIDTHS[0], WIDTHS[-1])).astype(np.float32) / 4
    return x, np.tanh(x @ teacher).astype(np.float32)


def torch_worker(rank: int, store: str, steps: int, b2: float, path: str, out: Any) -> None:
    """One gloo rank: train ``2 * steps`` steps, save after ``steps``, report losses.

    The objects that hold the process group live in ``torch_train`` and are gone when it
    returns; then a barrier, ``destroy_process_group`` and ``gc.collect()`` end it while the
    interpreter is alive (see examples/torch_train.py ``teardown``).
    """
    import gc

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=RANKS)
    losses = torch_train(rank, steps, b2, path)
    if rank == 0:
        out.put(losses)
    dist.barrier()  # every rank is done (rank 0 may still have been saving)
    dist.destroy_process_group()
    gc.collect()


def torch_train(rank: int, steps: int, b2: float, path: str) -> list[float]:
    """Train ``2 * steps`` steps on this rank's half of each batch; save after ``steps``."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from gradsync_torch import DataParallel, ResumableSampler, ZeroRedundancyOptimizer

    torch.manual_seed(0)  # every rank builds the same initial model

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(WIDTHS))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers[:-1]:
                x = torch.tanh(layer(x))
            return self.layers[-1](x)

    net = MLP()
    model = DataParallel(net)
    opt = ZeroRedundancyOptimizer(
        net.named_parameters(), torch.optim.AdamW, betas=(B1, b2), **HYPER
    )
    # Each step reads the next BATCH samples of the epoch's order; this rank takes its half.
    sampler = ResumableSampler(range(SAMPLES), seed=SEED, global_batch_size=BATCH)
    data = TensorDataset(*(torch.from_numpy(a) for a in dataset()))
    loader = DataLoader(data, batch_size=sampler.batch_size, sampler=sampler)
    losses: list[float] = []
    for epoch in itertools.count(sampler.epoch):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            losses.append(mean.item() / RANKS)
            if len(losses) == steps:  # weights, sharded optimizer state and data position
                opt.save(path, model=net, data=sampler)
            if len(losses) == 2 * steps:
                return losses
    raise AssertionError("unreachable: the epochs never end")


def train_in_torch(steps: int, b2: float, path: str) -> list[float]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [
            ctx.Process(target=torch_worker, args=(rank, store, steps, b2, path, out))
            for rank in range(RANKS)
        ]
        for p in procs:
            p.start()
        losses = out.get(timeout=600)
        for p in procs:
            p.join()
    if any(p.exitcode != 0 for p in procs):
        raise SystemExit(f"a torch rank failed: exit codes {[p.exitcode for p in procs]}")
    return losses


def continue_in_jax(steps: int, b2: float, path: str) -> list[float]:
    import flax.linen as fnn
    import jax
    import jax.numpy as jnp
    import optax

    from gradsync_core import Topology
    from gradsync_jax import (
        ResumableSampler,
        data_parallel_step,
        load_optimizer_state,
        load_params,
        mesh_from_topology,
        shard_optimizer,
    )

    class MLP(fnn.Module):
        @fnn.compact
        def __call__(self, x: jax.Array) -> jax.Array:
            for width in WIDTHS[1:-1]:
                x = jnp.tanh(fnn.Dense(width)(x))
            return fnn.Dense(WIDTHS[-1])(x)

    model = MLP()
    # Flax names the layers Dense_0..Dense_11, torch layers.0..layers.11.
    modules = {f"Dense_{i}": f"layers.{i}" for i in range(len(WIDTHS) - 1)}
    like = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
    params = load_params(path, like, modules=modules)
    mesh = mesh_from_topology(Topology.create(DEVICES), jax.devices()[:DEVICES])
    tx = shard_optimizer(
        optax.adamw(HYPER["lr"], b1=B1, b2=b2, eps=HYPER["eps"], weight_decay=0.01), mesh
    )
    # The position torch saved: the sampler continues with the very samples torch read next.
    sampler = ResumableSampler(SAMPLES, global_batch_size=BATCH, seed=SEED)
    opt_state, manifest = load_optimizer_state(path, tx, params, modules=modules, data=sampler)
    print(f"resumed at step {manifest.step}, data position {sampler.state_dict()}")

    def loss_fn(p: Any, batch: tuple[jax.Array, jax.Array]) -> jax.Array:
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)

    train_step = data_parallel_step(loss_fn, tx, mesh)
    x, y = dataset()
    losses = []
    for indices in itertools.islice(sampler, steps):  # one process: the whole global batch
        params, opt_state, loss = train_step(params, opt_state, (x[indices], y[indices]))
        losses.append(float(loss))
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps in each framework")
    parser.add_argument("--checkpoint", default=None, help="directory (default: a temp dir)")
    parser.add_argument("--plot", default=None, help="write a figure here (needs matplotlib)")
    parser.add_argument(
        "--b2", type=float, default=0.99, help="Adam's second-moment decay (torch's default: 0.999)"
    )
    args = parser.parse_args()
    print(
        f"config: torch, {RANKS} gloo ranks (DataParallel + ZeroRedundancyOptimizer(AdamW)), "
        f"trains {2 * args.steps} steps and saves after {args.steps}; JAX, {DEVICES} CPU "
        f"devices (shard_optimizer(optax.adamw), partition 'auto'), continues from that save; "
        f"MLP {WIDTHS[0]}-{WIDTHS[1]}x{len(WIDTHS) - 2}-{WIDTHS[-1]}, batch {BATCH}, "
        f"betas ({B1}, {args.b2}); baseline: "
        "the torch run's own second half"
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = args.checkpoint or os.path.join(tmp, "ckpt")
        torch_losses = train_in_torch(args.steps, args.b2, path)
        jax_losses = continue_in_jax(args.steps, args.b2, path)
    print(f"{'step':>4}  {'torch, 2 ranks':>15}  {'torch -> JAX, 8 devices':>24}")
    for step, loss in enumerate(torch_losses, start=1):
        resumed = jax_losses[step - args.steps - 1] if step > args.steps else None
        cell = "" if resumed is None else f"{resumed:.6f}"
        print(f"{step:>4}  {loss:>15.6f}  {cell:>24}")
    worst = max(
        abs(j - t) / abs(t) for j, t in zip(jax_losses, torch_losses[args.steps :], strict=True)
    )
    print(f"largest relative loss difference after the switch: {worst:.1e}")
    if args.plot:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot written")
            return
        steps = range(1, len(torch_losses) + 1)
        plt.plot(steps, torch_losses, label="torch, 2 ranks")
        plt.plot(steps[args.steps :], jax_losses, "--", label="torch -> JAX, 8 devices")
        plt.xlabel("step")
        plt.ylabel("loss")
        plt.legend()
        plt.savefig(args.plot)
        print(f"plot written to {args.plot}")


if __name__ == "__main__":
    main()
