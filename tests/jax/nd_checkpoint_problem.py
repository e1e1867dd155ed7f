"""The JAX composition's training problem for the checkpoints that cross layouts: the Llama
reference, its layouts on 8 CPU devices, the batches, the uninterrupted run, and a save after
``SAVED`` steps (``ParallelLlama.save``). Shared by tests/jax/test_nd_checkpoint.py and
tests/parity/test_cross_nd_checkpoint.py; it holds no tests of its own.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
from flax import nnx

import gradsync_jax
from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_nnx import Llama, ParallelLlama, parallelize, serial_loss
from gradsync_core import Topology
from gradsync_jax.sampler import ResumableSampler

RTOL = 1e-5  # the JAX compositions' reduction-order floor (tests/jax/test_nd_parallel.py)
STEPS, SAVED, BATCH, SEQ = 4, 2, 8, 16
LR, EPS, MAX_NORM = 1e-3, 1e-6, 0.5
DENSE = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
MOE = LlamaConfig(**{**DENSE.__dict__, "n_experts": 4, "top_k": 2})

# name: (topology arguments for 8 devices, options). "dp_shard2_tp2" on 8 devices is
# dp_replicate 2 x dp_shard 2 x tp 2 (HSDP x tp); it, "tp2_cp2_dp2_sp" and
# "dp_shard2_tp2_pp2" are the three dense compositions of issue 37 item 2 (the layouts of
# tests/jax/test_nd_parallel.py CONFIGS), the cp one with the dense model: the item's tp x cp
# x dp trains the tied model, whose embedding no pipeline takes ("tied-pp" there refuses it).
LAYOUTS: dict[str, tuple[dict[str, Any], ParallelOptions]] = {
    "dp_shard2_tp2": ({"tp": 2, "dp_shard": 2}, ParallelOptions()),
    "tp2_cp2_dp2_sp": ({"tp": 2, "cp": 2}, ParallelOptions(sequence_parallel=True)),
    "dp_shard2_tp2_pp2": ({"tp": 2, "pp": 2, "dp_shard": 2}, ParallelOptions(microbatches=4)),
    "dp4_tp2": ({"tp": 2}, ParallelOptions(sequence_parallel=False)),
    "ep2_dp_shard2_pp2_moe": (
        {"ep": 2, "pp": 2, "dp_shard": 2},
        ParallelOptions(microbatches=2, schedule="1F1B"),
    ),
}
# the model each layout trains: the dense one unless named here (item 2's MoE composition)
MODELS: dict[str, LlamaConfig] = {"ep2_dp_shard2_pp2_moe": MOE}
DENSE_COMPOSITIONS = ["dp_shard2_tp2", "tp2_cp2_dp2_sp", "dp_shard2_tp2_pp2"]

# (saved under, loaded under): every ordered pair of the three dense compositions (each saved
# once, by the first pair that loads it; the pipeline's stages' layers saved as the model's
# tree and loaded into stages), then HSDP x tp under dp x tp without sequence parallelism.
PAIRS = [
    *((a, b) for a in DENSE_COMPOSITIONS for b in DENSE_COMPOSITIONS if a != b),
    ("dp_shard2_tp2", "dp4_tp2"),
]


def batches(cfg: LlamaConfig = DENSE) -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, cfg.vocab_size, (BATCH, SEQ + 1)).astype(np.int32) for _ in range(4)]
    return [(r[:, :-1], r[:, 1:]) for r in rows]


def initial_params(cfg: LlamaConfig = DENSE) -> Any:
    return nnx.to_pure_dict(nnx.state(Llama(cfg, rngs=nnx.Rngs(0)), nnx.Param))


def transformation() -> optax.GradientTransformation:
    return optax.chain(gradsync_jax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))


@cache
def build(name: str, cfg: LlamaConfig = DENSE) -> ParallelLlama:
    """Layout ``name`` of a model with other initial weights than the training's (a load
    must replace them all); once per process, so that each layout's step compiles once
    (``ParallelLlama`` holds no parameters: ``place`` and ``load`` return new ones)."""
    sizes, options = LAYOUTS[name]
    model = Llama(cfg, rngs=nnx.Rngs(1))
    return parallelize(
        model, Topology.create(8, **sizes), options, tx=transformation(), seq_len=SEQ
    )


def train(
    par: ParallelLlama, stored: Any, state: Any, steps: range, losses: list[float] | None = None
) -> tuple[Any, Any]:
    """Train ``steps`` (indices into ``batches()``); each step's global loss appended to
    ``losses`` when given."""
    data = batches()
    for step in steps:
        stored, state, loss = par.step(stored, state, data[step])
        if losses is not None:
            losses.append(float(loss))
    return stored, state


@cache
def reference() -> tuple[Any, Any, list[float]]:
    """The uninterrupted run: the unsharded model on one device, ``STEPS`` steps: its
    parameters, optimizer state and each step's loss."""
    params = initial_params()
    graphdef = nnx.graphdef(Llama(DENSE, rngs=nnx.Rngs(0)))
    tx = optax.chain(optax.clip_by_global_norm(MAX_NORM), optax.adamw(LR, eps=EPS))

    @jax.jit
    def step(params: Any, state: Any, tokens: Any, targets: Any) -> Any:
        loss_fn = lambda p: serial_loss(nnx.merge(graphdef, p), tokens, targets)  # noqa: E731
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state, losses = tx.init(params), []
    for tokens, targets in batches():
        params, state, loss = step(params, state, tokens, targets)
        losses.append(float(loss))
    return jax.tree.map(np.asarray, params), jax.tree.map(np.asarray, state), losses


def save_after(name: str, directory: Path) -> Path:
    """Train ``SAVED`` steps under layout ``name`` from the initial weights of its model
    (``MODELS``), save (once)."""
    path = directory / name
    if not path.exists():
        cfg = MODELS.get(name, DENSE)
        par = build(name, cfg)
        stored = par.place(initial_params(cfg))
        stored, state = train(par, stored, par.init(stored), range(SAVED))
        data = sampler()
        for _ in range(SAVED):
            next(data)
        par.save(path, stored, state, step=SAVED, data=data)
    return path


def sampler() -> ResumableSampler:
    return ResumableSampler(64, global_batch_size=BATCH, seed=3)
