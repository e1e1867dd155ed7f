"""The JAX half of benchmarks/nd_parallel.py, in a process of its own (8 CPU devices, no torch).

    python benchmarks/_nd_parallel_jax.py '<options as JSON>'

For each dp x tp configuration, on the same NNX Llama (the same weights), the same batches and
the same clipped AdamW, alternating step by step (docs/design.md §11):

- gradsync: ``examples/llama_nnx.parallelize`` (one ``shard_map``: gradsync_jax's Megatron
  mappings with sequence parallelism, ``dp_shard`` chunks gathered per layer);
- GSPMD, the JAX-native way: the model's parameters placed by ``NamedSharding`` on a
  ``(dp, tp)`` mesh with the model's own Megatron specs (``nnx.get_partition_spec``: column
  kernels ``P(None, "tp")``, the output's among them, as gradsync's and torch's reference cut
  it, row kernels ``P("tp", None)``, the rest replicated), with
  ``dp_shard > 1`` also ``"dp"`` on each parameter's other dimension (MaxText's fsdp axis),
  the Adam state placed as its parameter, the batch rows over ``dp``, and the whole step under
  ``jax.jit``: XLA's partitioner picks the collectives.

Per configuration: each step's time (median over the timed rounds), the losses of every step
(the two must agree), the largest difference of their weights after the last step, and bytes
per device: parameters and Adam state held (the arrays'
shards), the compiled step's temporary bytes and its peak (``compiled_bytes``; both steps
donate their parameters and state, as a training loop does). The last line of stdout is one
JSON object.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import json  # after the flags above: they must precede importing jax
import statistics
import sys
import time
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # examples.*
import gradsync_jax
from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_nnx import Llama, parallelize, serial_loss
from gradsync_core import Topology

LR, WEIGHT_DECAY, MAX_NORM, EPS = 1e-3, 0.1, 1.0, 1e-6
GRADSYNC, GSPMD = "gradsync", "GSPMD"


def bytes_per_device(tree: Any) -> int:
    """The most bytes any device holds of ``tree``'s arrays, read from their shards."""
    held: dict[Any, int] = {}
    for leaf in jax.tree.leaves(tree):
        for shard in leaf.addressable_shards:
            held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
    return max(held.values())


def compiled_bytes(fn: Any, *args: Any) -> dict[str, int]:
    """XLA's ``memory_analysis`` of the compiled step, per device: its temporary bytes and
    its peak, the arguments + the outputs - the donated arguments the outputs reuse + the
    temporaries (an upper bound: XLA:CPU's own ``peak_memory_in_bytes`` leaves the
    temporaries out; measured here equal to the arguments plus 1 KB while the temporaries
    were 21 MB)."""
    stats = fn.lower(*args).compile().memory_analysis()
    temp = int(stats.temp_size_in_bytes)
    peak = (
        stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + temp
    )
    return {"temp": temp, "peak": int(peak)}


def gspmd_spec(role: P, shape: tuple[int, ...], fsdp: int) -> P:
    """The model's Megatron spec with ``"tp"``; with ``fsdp > 1`` also ``"dp"`` on the first
    other dimension it divides (MaxText's fsdp axis)."""
    entries = list(role) + [None] * (len(shape) - len(role))
    if fsdp > 1:
        for d, size in enumerate(shape):
            if entries[d] is None and size % fsdp == 0:
                entries[d] = "dp"
                break
    return P(*entries)


class _Gspmd:
    """The JAX-native step: NamedSharding placement, the whole step under ``jax.jit``."""

    def __init__(self, model: Llama, params: Any, mesh: Mesh, fsdp: int) -> None:
        roles = nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(model, nnx.Param)))
        specs = jax.tree.map(
            lambda r, x: gspmd_spec(r, np.shape(x), fsdp),
            roles,
            params,
            is_leaf=lambda x: isinstance(x, P),
        )
        named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        self.tx = optax.chain(
            optax.clip_by_global_norm(MAX_NORM),
            optax.adamw(LR, eps=EPS, weight_decay=WEIGHT_DECAY),
        )
        p_sh = jax.tree.map(named, specs, is_leaf=is_spec)
        state = self.tx.init(params)
        s_specs = optax.tree_map_params(
            self.tx, lambda _, s: s, state, specs, transform_non_params=lambda _: P()
        )
        s_sh = jax.tree.map(named, s_specs, is_leaf=is_spec)
        batch_sh = named(P("dp"))
        graphdef, tx = nnx.graphdef(model), self.tx

        def step(p: Any, s: Any, batch: Any) -> Any:
            tokens, targets = batch
            loss, g = jax.value_and_grad(
                lambda p: serial_loss(nnx.merge(graphdef, p), tokens, targets)
            )(p)
            updates, s = tx.update(g, s, p)
            return optax.apply_updates(p, updates), s, loss

        self.step = jax.jit(
            step,
            in_shardings=(p_sh, s_sh, (batch_sh, batch_sh)),
            out_shardings=(p_sh, s_sh, named(P())),
            donate_argnums=(0, 1),
        )
        self.batch_sh = batch_sh
        self.params = jax.device_put(params, p_sh)
        self.state = jax.device_put(state, s_sh)


class _Gradsync:
    """``examples/llama_nnx.parallelize`` on the topology."""

    def __init__(self, model: Llama, params: Any, topology: Topology, seq: int) -> None:
        tx = optax.chain(
            gradsync_jax.clip_by_global_norm(MAX_NORM),
            optax.adamw(LR, eps=EPS, weight_decay=WEIGHT_DECAY),
        )
        self.par = parallelize(model, topology, ParallelOptions(), tx=tx, seq_len=seq)
        # Donating the parameters and state, as a training loop (and jax_fsdp.py) does.
        self.step = jax.jit(self.par.step.__wrapped__, donate_argnums=(0, 1))
        self.batch_sh = NamedSharding(self.par.mesh, P())
        self.params = self.par.place(params)
        self.state = self.par.init(self.params)


def run_config(name: str, sizes: dict[str, int], options: dict[str, Any]) -> dict[str, Any]:
    """Both steps of one configuration, timed alternating; losses, bytes."""
    cfg = LlamaConfig(**options["config"])
    dp, tp = 8 // sizes["tp"], sizes["tp"]
    dp_shard = sizes.get("dp_shard", 1)
    topology = Topology.create(8, tp=tp, dp=dp, dp_shard=dp_shard)
    model = Llama(cfg, rngs=nnx.Rngs(0))
    # On the host: each side places its own copy (the steps donate their parameters).
    params = jax.tree.map(np.asarray, nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(dp, tp), ("dp", "tp"))
    runners: dict[str, Any] = {
        GRADSYNC: _Gradsync(model, params, topology, options["seq"]),
        GSPMD: _Gspmd(model, params, mesh, dp_shard),
    }
    rng = np.random.default_rng(7)
    steps = options["warmup"] + options["steps"]
    rows = [
        rng.integers(0, cfg.vocab_size, (options["batch"], options["seq"] + 1)).astype(np.int32)
        for _ in range(steps)
    ]
    batches = {
        key: [jax.device_put((r[:, :-1], r[:, 1:]), runner.batch_sh) for r in rows]
        for key, runner in runners.items()
    }
    figures: dict[str, Any] = {"sizes": sizes}
    for key, r in runners.items():
        figures[f"{key}_held_bytes"] = bytes_per_device([r.params, r.state])
        compiled = compiled_bytes(r.step, r.params, r.state, batches[key][0])
        figures[f"{key}_temp_bytes"] = compiled["temp"]
        figures[f"{key}_peak_bytes"] = compiled["peak"]
    times: dict[str, list[float]] = {k: [] for k in runners}
    losses: dict[str, list[float]] = {k: [] for k in runners}
    for i in range(steps):
        order = list(runners) if i % 2 == 0 else list(runners)[::-1]
        for key in order:
            r = runners[key]
            start = time.perf_counter()
            r.params, r.state, loss = r.step(r.params, r.state, batches[key][i])
            jax.block_until_ready((r.params, r.state, loss))
            elapsed = time.perf_counter() - start
            losses[key].append(float(loss))
            if i >= options["warmup"]:
                times[key].append(elapsed)
    ours, theirs = runners[GRADSYNC], runners[GSPMD]
    mine = jax.tree.leaves(ours.par.params_of(ours.params))
    other = jax.tree.leaves(jax.tree.map(np.asarray, theirs.params))
    figures["param_difference"] = max(
        float(np.max(np.abs(np.asarray(a) - b))) for a, b in zip(mine, other, strict=True)
    )
    step_s = {k: statistics.median(t) for k, t in times.items()}
    pairs = zip(losses[GRADSYNC], losses[GSPMD], strict=True)
    figures.update(
        {
            "step_s": step_s,
            "ratio": step_s[GRADSYNC] / step_s[GSPMD],
            "losses": losses,
            "loss_difference": max(abs(a - b) / abs(b) for a, b in pairs),
        }
    )
    return figures


def main() -> None:
    options = json.loads(sys.argv[1])
    results = {name: run_config(name, sizes, options) for name, sizes in options["configs"]}
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
