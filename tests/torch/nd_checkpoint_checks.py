"""Checks of the checkpoint that crosses layouts (``save_boxes`` / ``load_boxes``) on the Llama
reference, run inside 8 spawned gloo ranks by ``test_nd_checkpoint.py``.

Each saved layout of issue 37's compositions trains ``SAVED`` steps and saves once
(``save_layout``); each pair loads that checkpoint under another layout (another tp, cp, ep,
dp or pp size, another schedule), trains the remaining steps, and compares every rank's
parameters AND AdamW moments, and the global losses of the steps after the load, with the
same model trained ``STEPS`` steps uninterrupted in one process: float64 and
``nd_checks.RTOL``, as the compositions themselves are checked. The checkpoints are left in
``directory`` for the test to load in one process (torch) and in JAX.

This module holds no tests of its own.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from examples.llama_config import LlamaConfig, ParallelOptions
from examples.llama_torch import Llama, ParallelLlama, lm_loss_share, local_state, parallelize
from gradsync_core import Topology
from gradsync_torch.checkpoint import boxes as boxes_module
from gradsync_torch.checkpoint import load_boxes, save_boxes
from tests.support.harness import Skip
from tests.torch.nd_checks import (
    DENSE,
    LR,
    MAX_NORM,
    MOE,
    RTOL,
    SEQ,
    STEPS,
    against_reference,
    assert_close_pairs,
    batches,
    full_piece,
    raises_naming,
    same_everywhere,
)

SAVED = 2  # steps before the save; STEPS - SAVED after the load

# name: (config, topology arguments for 8 ranks, options)
LAYOUTS: dict[str, tuple[LlamaConfig, dict[str, Any], ParallelOptions]] = {
    "dp_shard2_tp2_pp2": (DENSE, {"tp": 2, "pp": 2}, ParallelOptions(microbatches=2)),
    "dp_replicate2_dp_shard2_tp2": (DENSE, {"tp": 2, "dp_shard": 2}, ParallelOptions()),
    "tp2_cp2_dp2_sp": (DENSE, {"tp": 2, "cp": 2}, ParallelOptions(sequence_parallel=True)),
    "dp2_pp4_gpipe": (DENSE, {"pp": 4}, ParallelOptions(microbatches=4, schedule="GPipe")),
    "dp8": (DENSE, {}, ParallelOptions()),
    "ep2_dp_shard2_pp2_moe": (MOE, {"ep": 2, "pp": 2, "dp_shard": 2}, ParallelOptions(2)),
    "ep2_dp8_moe": (MOE, {"ep": 2}, ParallelOptions()),
    "ep4_dp_shard8_moe": (MOE, {"ep": 4}, ParallelOptions()),
}

# (saved under, loaded under): every ordered pair of the three dense item-2 compositions
# (dp_shard x tp x pp, HSDP x tp, tp x cp x dp), then the pipeline under another pp size and
# schedule, and dp alone; the MoE composition both ways, its ep, pp and dp changed at once.
# Each layout is saved once (``save_layout``) and loaded by every pair that names it.
PAIRS = [
    ("dp_shard2_tp2_pp2", "tp2_cp2_dp2_sp"),
    ("dp_shard2_tp2_pp2", "dp_replicate2_dp_shard2_tp2"),
    ("tp2_cp2_dp2_sp", "dp_replicate2_dp_shard2_tp2"),
    ("tp2_cp2_dp2_sp", "dp_shard2_tp2_pp2"),
    ("dp_replicate2_dp_shard2_tp2", "dp_shard2_tp2_pp2"),
    ("dp_replicate2_dp_shard2_tp2", "tp2_cp2_dp2_sp"),
    ("dp_replicate2_dp_shard2_tp2", "dp2_pp4_gpipe"),
    ("dp2_pp4_gpipe", "dp8"),
    ("ep2_dp_shard2_pp2_moe", "ep4_dp_shard8_moe"),
    ("ep4_dp_shard8_moe", "ep2_dp_shard2_pp2_moe"),
]
SAVES = list(dict.fromkeys(saved for saved, _ in PAIRS))


def pair_name(saved: str, loaded: str) -> str:
    return f"{saved}->{loaded}"


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, foreach=False)


def _build(name: str, ws: int) -> tuple[ParallelLlama, torch.optim.Optimizer]:
    config, sizes, options = LAYOUTS[name]
    topology = Topology.create(ws, **sizes)
    model = parallelize(Llama(config, seed=1).double(), topology, options, seq_len=SEQ)
    return model, _adamw(list(model.parameters()))


def _train(model: ParallelLlama, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """Train ``steps``; returns each step's global mean loss (a collective)."""
    data, losses = batches(), []
    for step in steps:
        losses.append(_global_loss(model, model.step(*data[step])))
        model.clip_grad_norm_(MAX_NORM)
        opt.step()
        opt.zero_grad()
    return losses


def _global_loss(model: ParallelLlama, share: torch.Tensor | None) -> float:
    """The global mean loss from every rank's share: a replica's shares add up over the axes
    that split its tokens (cp; tp under sequence parallelism), the last pipeline stage alone
    holds them, tp ranks without sequence parallelism hold the same share, and the replicas'
    losses are averaged over dp."""
    total = torch.zeros((), dtype=torch.float64) if share is None else share.double().clone()
    dist.all_reduce(total)
    topology = model.topology
    copies = topology.tp if topology.tp > 1 and not model.options.sequence_parallel else 1
    return float(total) / (topology.dp * copies)


REFERENCE_LOSSES: dict[tuple[LlamaConfig, int], list[float]] = {}  # filled by reference


@functools.cache
def reference(config: LlamaConfig, steps: int = STEPS) -> tuple[Llama, torch.optim.Optimizer]:
    """One process, ``steps`` steps on the whole batch, no checkpoint (computed once per
    process: read it, never train it further)."""
    model = Llama(config, seed=1).double()
    opt = _adamw(model.parameters())
    losses = REFERENCE_LOSSES.setdefault((config, steps), [])
    for tokens, targets in batches()[:steps]:
        loss = lm_loss_share(model(tokens), targets, tokens.numel())
        losses.append(float(loss.detach()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    return model, opt


def compare(model: ParallelLlama, opt: torch.optim.Optimizer, name: str) -> dict[str, float]:
    """Every rank's parameters and moments against the uninterrupted single-process run
    (a collective: every gather first, the assertions after). Returns the largest
    differences."""
    ref, ref_opt = reference(model.config)
    pairs, worst = against_reference(model, opt, ref, ref_opt)
    assert_close_pairs(pairs, name)
    return worst


@contextlib.contextmanager
def _counting_reads() -> Any:
    """The bytes ``load_boxes`` reads of tensor data (its one read function, spied on)."""
    original = boxes_module._Files.elements
    read = {"bytes": 0}

    def elements(self: Any, file: str, key: str, start: int, stop: int) -> torch.Tensor:
        out = original(self, file, key, start, stop)
        read["bytes"] += out.numel() * out.element_size()
        return out

    boxes_module._Files.elements = elements  # type: ignore[method-assign]
    try:
        yield read
    finally:
        boxes_module._Files.elements = original  # type: ignore[method-assign]


def save_layout(rank: int, ws: int, saved: str, directory: str) -> None:
    """Train SAVED steps under layout ``saved`` and save (``directory/saved``)."""
    model, opt = _build(saved, ws)
    _train(model, opt, range(SAVED))
    path = os.path.join(directory, saved)
    save_boxes(path, model.held(), opt, specs=model.specs(), layout=model.layout())


def check_pair(rank: int, ws: int, saved: str, loaded: str, directory: str) -> None:
    """Load the checkpoint ``save_layout`` wrote under ``saved`` into layout ``loaded``, train
    the remaining steps, compare with the uninterrupted run."""
    name = pair_name(saved, loaded)
    path = os.path.join(directory, saved)
    model, opt = _build(loaded, ws)
    held = model.held()
    with _counting_reads() as read:
        manifest = load_boxes(path, held, opt, specs=model.specs())
    # Each rank read its boxes' elements of the weight and of each state tensor, no more.
    kinds = 1 + sum(k != "step" for k in manifest.state_keys[held[0].name])
    wanted = sum(h.box.numel * h.param.element_size() for h in held) * kinds
    assert read["bytes"] == wanted, f"rank {rank} read {read['bytes']} bytes, its boxes {wanted}"
    assert manifest.step == SAVED, manifest.step
    assert (
        manifest.extra["layout"]["topology"] == Topology.create(ws, **LAYOUTS[saved][1]).to_json()
    )
    losses = _train(model, opt, range(SAVED, STEPS))
    worst = compare(model, opt, name)
    want = REFERENCE_LOSSES[(model.config, STEPS)][SAVED:]
    assert all(abs(a - b) <= RTOL * abs(b) for a, b in zip(losses, want, strict=True)), (
        f"{name}: losses after the load {losses}, uninterrupted {want}"
    )
    worst["loss"] = max(abs(a - b) / abs(b) for a, b in zip(losses, want, strict=True))
    everywhere: list[Any] = [None] * ws
    dist.all_gather_object(everywhere, worst)
    if rank == 0:
        merged = {k: max(w[k] for w in everywhere) for k in worst}
        Path(directory, f"{name}.json").write_text(json.dumps(merged))


def _unchanged(model: ParallelLlama, opt: torch.optim.Optimizer, before: list[torch.Tensor]):
    after = [p.detach().to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True)), "weights changed"
    assert not opt.state, "optimizer state changed"


def check_refusals(rank: int, ws: int, directory: str) -> None:
    """Loads that cannot be expressed or do not match refuse with one sentence on every rank
    before anything changes: the checkpoint of ``dp8`` (saved by ``check_pair``) into another
    model, into another dtype, with pieces that leave elements out; a layout whose tp does
    not divide the head count refuses before any load."""
    path = os.path.join(directory, "dp2_pp4_gpipe")  # save_layout saves it; a dense model
    cases = [
        ("ep2_dp8_moe", None, "checkpoint has no state for parameter"),
        ("dp8", torch.float32, "float32 here but"),
        ("dp8", "drop", "every element must be on some rank"),
        ("tp2_cp2_dp2_sp", "undescribed", "is in no Held piece"),  # replicas hold it
    ]
    for name, change, needle in cases:
        model, opt = _build(name, ws)
        if isinstance(change, torch.dtype):
            config, sizes, options = LAYOUTS[name]
            whole = Llama(config, seed=1).to(change)
            model = parallelize(whole, Topology.create(ws, **sizes), options, seq_len=SEQ)
            opt = _adamw(list(model.parameters()))
        held = model.held()
        if change == "drop" and rank == 3:
            held = held[1:]  # rank 3's rows of the embedding: nobody else holds them
            # The optimizer must not step what no piece describes: the same rank's optimizer
            # without that parameter.
            opt = _adamw([h.param for h in held])
        if change == "undescribed" and rank == 3:
            held = held[1:]  # its optimizer still steps that parameter
        before = [p.detach().to_local().clone() for p in model.parameters()]
        message = raises_naming(
            lambda m=model, h=held, o=opt: load_boxes(path, h, o, specs=m.specs()),
            "cannot load checkpoint",
            needle,
        )
        same_everywhere(message)
        _unchanged(model, opt, before)
    # A save whose ranks step differently built optimizers: refused before any file is written.
    model, _ = _build("dp8", ws)
    opt = torch.optim.AdamW(list(model.parameters()), lr=LR * (2 if rank == 2 else 1))
    target = os.path.join(directory, "refused")
    message = raises_naming(
        lambda: save_boxes(target, model.held(), opt, specs=model.specs()),
        "cannot save checkpoint",
        "param group 0 has other hyper-parameters on rank 2",
    )
    same_everywhere(message)
    assert not os.path.exists(target), os.listdir(directory)
    config = LlamaConfig(**{**DENSE.__dict__})
    message = raises_naming(
        lambda: parallelize(Llama(config), Topology.create(ws, tp=4), seq_len=SEQ),
        "n_kv_heads 2 is not divisible by tp=4",
    )
    same_everywhere(message)


JAX_SAVED = "jax-dp8"  # the directory the test's JAX save writes, beside the torch ones
JAX_LOADED = "dp_shard2_tp2_pp2"


def save_in_jax(path: str) -> None:
    """The NNX twin (float32) trained ``SAVED`` steps by gradsync_jax's data-parallel step
    with a ``shard_optimizer`` of AdamW over 8 devices, saved by ``save_optimizer_state``
    with its weights (a flat plan of 8 rank files): run in the test's own process."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from examples.llama_nnx import Llama as NNXLlama
    from examples.llama_nnx import serial_loss
    from gradsync_jax import data_parallel_step, mesh_from_topology, shard_optimizer
    from gradsync_jax.checkpoint import save_optimizer_state

    model = NNXLlama(DENSE, rngs=nnx.Rngs(5))
    graphdef = nnx.graphdef(model)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    mesh = mesh_from_topology(Topology.create(8), jax.devices()[:8])
    adamw = optax.adamw(LR, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.1)
    tx = shard_optimizer(adamw, mesh)
    state = tx.init(params)

    def loss_fn(p: Any, batch: Any) -> Any:
        return serial_loss(nnx.merge(graphdef, p), *batch)

    step = data_parallel_step(loss_fn, tx, mesh)
    for tokens, targets in batches()[:SAVED]:
        params, state, _ = step(params, state, (jnp.asarray(tokens), jnp.asarray(targets)))
    save_optimizer_state(path, tx, state, params, step=SAVED, model=params)


def check_jax_checkpoint(rank: int, ws: int, directory: str) -> None:
    """The JAX checkpoint loads under a torch layout: every rank's pieces of the weights and
    AdamW moments equal, exactly, what one torch process loads from it with the plain
    loaders."""
    from gradsync_torch.checkpoint import load_model_weights, load_optimizer_state_dict

    path = os.path.join(directory, JAX_SAVED)
    if not os.path.exists(path):
        raise Skip(f"no JAX checkpoint at {path} (JAX is not installed)")
    config, sizes, options = LAYOUTS[JAX_LOADED]
    topology = Topology.create(ws, **sizes)
    model = parallelize(Llama(config, seed=9), topology, options, seq_len=SEQ)
    opt = _adamw(list(model.parameters()))
    manifest = load_boxes(path, model.held(), opt, specs=model.specs())
    assert (manifest.framework, manifest.step) == ("jax", SAVED)
    whole = Llama(config, seed=9)
    whole_opt = _adamw(whole.parameters())
    load_model_weights(path, whole)
    load_optimizer_state_dict(path, whole_opt, whole)
    named = dict(whole.named_parameters())
    pairs = []
    for part in model.parts:
        want = {"params": local_state(part, {n: p.detach() for n, p in named.items()})}
        for key in ("exp_avg", "exp_avg_sq"):
            want[key] = local_state(part, {n: whole_opt.state[p][key] for n, p in named.items()})
        for pname, param in part.named_parameters():
            got = {
                "params": param.detach(),
                **{k: opt.state[param][k] for k in want if k != "params"},
            }
            pairs += [(k, pname, full_piece(v), want[k][pname]) for k, v in got.items()]
    for kind, pname, actual, expected in pairs:
        assert torch.equal(actual, expected), f"{kind} of {pname} differs from one process's"
