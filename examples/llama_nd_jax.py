"""Train the Llama reference on 8 CPU devices with every axis from flags (issue 37).

    python examples/llama_nd_jax.py --dp-shard 2 --tp 2 --pp 2
    python examples/llama_nd_jax.py --dp-replicate 2 --dp-shard 2 --tp 2
    python examples/llama_nd_jax.py --tp 2 --cp 2 --dp-shard 2
    python examples/llama_nd_jax.py --ep 2 --dp-shard 2 --dp-replicate 2 --pp 2 --experts 4
    # save under one layout, resume under another (or in examples/llama_nd.py, torch)
    python examples/llama_nd_jax.py --dp-shard 2 --tp 2 --save /tmp/ckpt-jax
    python examples/llama_nd_jax.py --tp 2 --pp 2 --resume /tmp/ckpt-jax

The JAX twin of ``examples/llama_nd.py``. The product of the sizes (``ep`` is carved out of
the data-parallel ranks, as Megatron-core's) must be the device count. It prints the plan
(the mesh, each parameter's ``PartitionSpec``, the batch's, the pipeline's schedule), trains
``--steps`` steps of clipped AdamW with ``examples/llama_nnx.py``'s ``parallelize`` and the
same model on one device beside it, prints both losses per step, and ends with one JSON line.
``--save DIR`` writes a checkpoint after training (``ParallelLlama.save``: model space, the
layout in its manifest); ``--resume DIR`` loads one saved under any layout, by either framework
(``ParallelLlama.load``; the one-device model beside it reads it with ``load_params`` and
``load_optimizer_state``), and continues from its step.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # after the flags above: they must precede importing jax
import json
import sys
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.*
import gradsync_jax
from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_nnx import Llama, parallelize, serial_loss
from gradsync_core import Topology
from gradsync_core.checkpoint import describe_layout
from gradsync_jax import load_optimizer_state, load_params


def _flags(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for axis in ("dp-shard", "dp-replicate", "tp", "cp", "pp", "ep"):
        parser.add_argument(f"--{axis}", type=int, default=1)
    parser.add_argument("--experts", type=int, default=0, help="MoE experts (0: dense MLP)")
    parser.add_argument("--no-sequence-parallel", action="store_true")
    parser.add_argument("--schedule", default="1F1B")
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save", metavar="DIR", help="write a checkpoint here after training")
    parser.add_argument(
        "--resume", metavar="DIR", help="continue from a checkpoint saved under any layout"
    )
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the example; returns the summary it prints last."""
    args = _flags(argv)
    dp = args.dp_shard * args.dp_replicate
    world = dp * args.tp * args.cp * args.pp
    topology = Topology.create(
        world, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, dp=dp, dp_shard=args.dp_shard
    )
    cfg = LlamaConfig(vocab_size=64, dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=64)
    if args.experts:
        cfg = LlamaConfig(**{**cfg.__dict__, "n_experts": args.experts})
    options = ParallelOptions(
        microbatches=args.microbatches,
        schedule=args.schedule,
        sequence_parallel=not args.no_sequence_parallel,
    )
    model = Llama(cfg, rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tx = optax.chain(gradsync_jax.clip_by_global_norm(1.0), optax.adamw(args.lr, eps=1e-6))
    par = parallelize(model, topology, options, tx=tx, seq_len=args.seq)

    print(f"mesh: {dict(par.mesh.shape)}")
    if topology.ep > 1:
        print(f"expert-parallel groups {topology.groups('ep')} on mesh axes {par.axes.ep}")
    print(f"batch: {par.batch_spec}; forward axes: {par.axes}")
    if par.plan is not None:
        plan = par.plan
        print(
            f"pipeline: {plan.schedule}, {plan.microbatches} microbatches, {plan.num_stages} stages"
        )
    for path, spec in jax.tree_util.tree_flatten_with_path(
        par.param_specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)
    )[0][:12]:
        print(f"  {jax.tree_util.keystr(path):<60} {spec}")

    graphdef = nnx.graphdef(model)
    ref_tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(args.lr, eps=1e-6))

    @jax.jit
    def serial_step(p: Any, s: Any, tokens: Any, targets: Any) -> Any:
        loss, g = jax.value_and_grad(
            lambda p: serial_loss(nnx.merge(graphdef, p), tokens, targets)
        )(p)
        u, s = ref_tx.update(g, s, p)
        return optax.apply_updates(p, u), s, loss

    stored = par.place(params)
    state = par.init(stored)
    ref, ref_state = params, ref_tx.init(params)
    first = 0
    if args.resume:
        stored, state, manifest = par.load(args.resume)
        ref = load_params(args.resume, params)  # the one-device model reads it too
        ref_state, _ = load_optimizer_state(args.resume, ref_tx, params)
        first = manifest.step
        layout = describe_layout(manifest.extra.get("layout"))
        print(f"resumed {args.resume} at step {first}; it was saved under: {layout}")
    rng = np.random.default_rng(0)
    for _ in range(first):  # the batches the saved run already trained on
        rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1))
    print(f"{'step':>4} {'loss':>10} {'one device':>11}")
    for step in range(first, first + args.steps):
        rows = rng.integers(0, cfg.vocab_size, (args.batch, args.seq + 1)).astype(np.int32)
        tokens, targets = rows[:, :-1], rows[:, 1:]
        stored, state, loss = par.step(stored, state, (tokens, targets))
        ref, ref_state, ref_loss = serial_step(ref, ref_state, tokens, targets)
        print(f"{step:>4} {float(loss):>10.6f} {float(ref_loss):>11.6f}")
    drift = max(
        float(np.abs(a - np.asarray(b)).max() / max(float(np.abs(np.asarray(b)).max()), 1e-30))
        for a, b in zip(jax.tree.leaves(par.params_of(stored)), jax.tree.leaves(ref), strict=True)
    )
    summary = {
        "example": "llama_nd_jax",
        "mesh": dict(par.mesh.shape),
        "ep": topology.ep,
        "final_loss": round(float(loss), 6),
        "one_device_final_loss": round(float(ref_loss), 6),
        "max_relative_param_difference": drift,
    }
    if args.save:
        par.save(args.save, stored, state, step=first + args.steps)
        print(f"saved {args.save}: resume under any layout with --resume {args.save}")
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
