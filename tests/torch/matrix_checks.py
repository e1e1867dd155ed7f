"""Workers of the matrix-optimizer tests: a GPT trained with Muon (matrices) and AdamW (the rest).

Each run wraps ``torch.optim.Muon`` in ``gradsync_torch.MatrixOptimizer`` under one sharding
(``fully_shard``: ZeRO-3; ``DataParallel`` + ``ZeroRedundancyOptimizer``: ZeRO-1; local
gradients + ``shard_gradients=True``: ZeRO-2) and checks it two ways:

- ``pair``: a replica in the same rank, stepped by a plain ``torch.optim.Muon`` and
  ``torch.optim.AdamW`` with the very gradients the sharded run reduced, must hold the same
  bits: parameters and Muon's momentum (the matrix step runs whole on one rank, so the only
  freedom is the reduction order, which the replica shares);
- ``reference``: one process on the full batch, 5 steps: equal within the reduction-order
  floor (the sharded gradients are sums in another order).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from examples.pipeline_models import Layer, gpt_blocks, lm_loss, token_batch

STEPS = 5
BATCH = 8  # divisible by 1, 2 and 4 ranks
SEQ, VOCAB, WIDTH = 8, 32, 16


def gpt() -> nn.Sequential:
    return gpt_blocks(layers=2, width=WIDTH, heads=2, vocab=VOCAB, seq=SEQ, seed=0)


def is_matrix(name: str, param: torch.Tensor, model: nn.Module) -> bool:
    """Muon's parameters, as its users pick them: the 2-D weights of the hidden layers (the
    embeddings and the output layer go to AdamW)."""
    block = model.get_submodule(name.rpartition(".")[0].rpartition(".")[0] or name)
    return param.ndim == 2 and isinstance(block, Layer)


def split(model: nn.Module) -> tuple[list[Any], list[Any]]:
    matrices, others = [], []
    for name, param in model.named_parameters():
        (matrices if is_matrix(name, param, model) else others).append((name, param))
    return matrices, others


def optimizers(model: nn.Module) -> tuple[torch.optim.Muon, torch.optim.AdamW]:
    matrices, others = split(model)
    return torch.optim.Muon(matrices, lr=0.02), torch.optim.AdamW(others, lr=1e-3)


def batch(step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = token_batch(BATCH, SEQ, VOCAB, seed=100 + step)
    n = BATCH // world_size
    return tokens[rank * n : (rank + 1) * n], targets[rank * n : (rank + 1) * n]


def whole(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def build(sharding: str, world_size: int) -> dict[str, Any]:
    """The model under ``sharding`` and its two optimizers (plus a DataParallel wrapper)."""
    from gradsync_torch import DataParallel, MatrixOptimizer, ZeroRedundancyOptimizer, fully_shard

    model = gpt()
    run: dict[str, Any] = {"model": model, "forward": model}
    matrices, others = split(model)
    if sharding == "zero3":
        for block in model:
            if isinstance(block, Layer):
                fully_shard(block)
        fully_shard(model)
        matrices, others = split(model)
        run["muon"] = MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02))
        run["adamw"] = torch.optim.AdamW(others, lr=1e-3)
    elif sharding == "zero1":
        run["forward"] = DataParallel(model)
        run["muon"] = MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02))
        run["adamw"] = ZeroRedundancyOptimizer(others, torch.optim.AdamW, lr=1e-3)
    elif sharding == "zero2":
        run["muon"] = MatrixOptimizer(torch.optim.Muon(matrices, lr=0.02), shard_gradients=True)
        run["adamw"] = ZeroRedundancyOptimizer(
            others, torch.optim.AdamW, shard_gradients=True, lr=1e-3
        )
    else:
        raise ValueError(sharding)
    return run


def reduced_grads(run: dict[str, Any], sharding: str, world_size: int) -> dict[str, torch.Tensor]:
    """The gradients the sharded run steps with, whole, on every rank (after its step: under
    ZeRO-2 the owner of each matrix holds its reduced gradient then)."""
    model, muon = run["model"], run["muon"]
    out = {}
    if sharding == "zero2":
        for m in muon.matrices:
            grad = m.param.grad if m.owner == muon.rank else torch.empty(m.shape)
            if world_size > 1:
                dist.broadcast(grad, src=m.owner)
            out[m.name] = grad
        return out
    for name, param in model.named_parameters():
        if param.grad is not None:
            out[name] = whole(param.grad).detach().clone()
    return out


def pair(rank: int, world_size: int, sharding: str) -> dict[str, Any]:
    """Bitwise: the sharded run and a replica fed its reduced gradients."""
    run = build(sharding, world_size)
    replica = gpt()
    ref_muon, ref_adamw = optimizers(replica)
    ref_params = dict(replica.named_parameters())
    matrix_names = {n for n, _ in split(replica)[0]}
    for step in range(STEPS):
        tokens, targets = batch(step, rank, world_size)
        lm_loss(run["forward"](tokens), targets).backward()
        grads_before = None if sharding == "zero2" else reduced_grads(run, sharding, world_size)
        run["muon"].step()
        run["adamw"].step()
        grads = grads_before or reduced_grads(run, sharding, world_size)
        for name, p in ref_params.items():
            # Under ZeRO-2 AdamW's reduced gradients are shards inside its optimizer: the
            # replica's other parameters are left alone (tests/torch/test_zero.py checks them).
            p.grad = grads[name].clone() if name in grads else None
        ref_muon.step()
        ref_adamw.step()
        run["muon"].zero_grad()
        run["adamw"].zero_grad()
        ref_muon.zero_grad()
        ref_adamw.zero_grad()
        for name, p in run["model"].named_parameters():
            mine, ref = whole(p).detach(), ref_params[name].detach()
            if name in matrix_names or sharding != "zero2":
                assert torch.equal(mine, ref), (
                    f"{sharding} step {step}: {name} differs by {(mine - ref).abs().max():.3g}"
                )
    state = run["muon"].full_state()
    for name, p in ref_params.items():
        if name in matrix_names:
            mine, ref = state[name]["momentum_buffer"], ref_muon.state[p]["momentum_buffer"]
            assert torch.equal(mine, ref), f"{sharding}: momentum of {name} differs"
    return {
        "exchanged": run["muon"].exchanged,
        "predicted": run["muon"].owner_plan.rows_exchange(run["muon"].rank),
        "fingerprint": run["muon"].owner_plan.fingerprint,
        "matrices": len(state),
    }


def reference(rank: int, world_size: int, sharding: str) -> dict[str, Any] | None:
    """The sharded run's parameters and Muon momenta, whole (``name`` and
    ``name:momentum_buffer``), after ``STEPS`` steps, as NumPy arrays (tensors do not
    outlive a worker through the result queue); on rank 0 only."""
    run = build(sharding, world_size)
    for step in range(STEPS):
        tokens, targets = batch(step, rank, world_size)
        lm_loss(run["forward"](tokens), targets).backward()
        run["muon"].step()
        run["adamw"].step()
        run["muon"].zero_grad()
        run["adamw"].zero_grad()
    out = {name: whole(p).detach().clone() for name, p in run["model"].named_parameters()}
    for name, state in run["muon"].full_state().items():
        out[f"{name}:momentum_buffer"] = state["momentum_buffer"]
    return {k: v.numpy() for k, v in out.items()} if rank == 0 else None


def one_process(world_size: int, order: list[int] | None = None) -> dict[str, torch.Tensor]:
    """One process, the same ``STEPS``: the gradient of each rank's slice of the batch,
    divided by ``world_size`` and summed in ``order`` (rank order by default: with 2 ranks
    any order gives the same sums; with 1 the full batch). On one thread, as the ranks run:
    a matrix product's sums are cut by thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _one_process(world_size, order)
    finally:
        torch.set_num_threads(threads)


def _one_process(world_size: int, order: list[int] | None) -> dict[str, torch.Tensor]:
    model = gpt()
    muon, adamw = optimizers(model)
    for step in range(STEPS):
        grads: list[torch.Tensor] | None = None
        for r in order or range(world_size):
            tokens, targets = batch(step, r, world_size)
            model.zero_grad()
            lm_loss(model(tokens), targets).backward()
            mine = [p.grad / world_size for p in model.parameters()]
            grads = mine if grads is None else [a + b for a, b in zip(grads, mine, strict=True)]
        assert grads is not None
        for p, g in zip(model.parameters(), grads, strict=True):
            p.grad = g
        muon.step()
        adamw.step()
        model.zero_grad()
    out = {name: p.detach().clone() for name, p in model.named_parameters()}
    for name, p in split(model)[0]:
        out[f"{name}:momentum_buffer"] = muon.state[p]["momentum_buffer"]
    return out


def largest_difference(a: dict[str, Any], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((torch.as_tensor(a[k]) - b[k]).abs().max().item() for k in a)


def train(run: dict[str, Any], steps: range, rank: int, world_size: int) -> None:
    for step in steps:
        tokens, targets = batch(step, rank, world_size)
        lm_loss(run["forward"](tokens), targets).backward()
        run["muon"].step()
        run["adamw"].step()
        run["muon"].zero_grad()
        run["adamw"].zero_grad()


def snapshot(run: dict[str, Any]) -> dict[str, Any]:
    """Parameters and Muon state (NumPy), whole, as ``reference`` returns them (a
    collective: call it on every rank)."""
    out = {name: whole(p).detach().numpy().copy() for name, p in run["model"].named_parameters()}
    for name, state in run["muon"].full_state().items():
        out[f"{name}:momentum_buffer"] = state["momentum_buffer"].numpy()
    return out


def save_after(rank: int, world_size: int, sharding: str, path: str, steps: int) -> Any:
    """Train ``steps`` steps under ``sharding``, then save Muon (``MatrixOptimizer.save``)
    and the model with AdamW (``save_param_shards`` or ``ZeroRedundancyOptimizer.save``)."""
    from gradsync_torch import save_param_shards

    run = build(sharding, world_size)
    train(run, range(steps), rank, world_size)
    run["muon"].save(f"{path}/muon")
    if sharding == "zero3":
        save_param_shards(f"{path}/rest", run["model"], run["adamw"])
    else:
        run["adamw"].save(f"{path}/rest", model=run["model"])
    saved = snapshot(run)  # a collective
    return saved if rank == 0 else None


def load_and_continue(
    rank: int, world_size: int, sharding: str, path: str, start: int
) -> tuple[Any, Any]:
    """Load what ``save_after`` wrote (any world size, any sharding) and train to ``STEPS``:
    (the loaded snapshot, the final one) on rank 0."""
    from gradsync_torch import load_param_shards

    run = build(sharding, world_size)
    if sharding == "zero3":
        load_param_shards(f"{path}/rest", run["model"], run["adamw"])
    else:
        run["adamw"].load(f"{path}/rest", model=run["model"])
    run["muon"].load(f"{path}/muon")
    loaded = snapshot(run)
    train(run, range(start, STEPS), rank, world_size)
    final = snapshot(run)
    return (loaded, final) if rank == 0 else (None, None)


def refusals(rank: int, world_size: int) -> None:
    """What ``MatrixOptimizer`` refuses, each with its sentence, on every rank alike."""
    import pytest

    from gradsync_torch import MatrixOptimizer, fully_shard

    with pytest.raises(TypeError, match="wraps a torch optimizer instance"):
        MatrixOptimizer(torch.optim.Muon)  # type: ignore[arg-type]
    net = gpt()
    fully_shard(net[1])  # the first layer's rows, the second layer whole
    mixed = [p for n, p in split(net)[0]]
    with pytest.raises(ValueError, match="partly row shards of fully_shard and partly whole"):
        MatrixOptimizer(torch.optim.Muon(mixed))
    rows = [p for n, p in split(net)[0] if n.startswith("1.")]
    with pytest.raises(ValueError, match="leave process_group and shard_gradients out"):
        MatrixOptimizer(torch.optim.Muon(rows), shard_gradients=True)
    muon = MatrixOptimizer(torch.optim.Muon(split(gpt())[0]))
    with pytest.raises(ValueError, match="plans its owners once"):
        muon.add_param_group({"params": [torch.zeros(2, 2, requires_grad=True)]})
    with pytest.raises(RuntimeError, match="consolidate_state_dict"):
        muon.state_dict()
    from gradsync_torch import save_param_shards

    sharded = gpt()
    fully_shard(sharded)
    wrapped = MatrixOptimizer(torch.optim.Muon(split(sharded)[0]))
    with pytest.raises(ValueError, match="a MatrixOptimizer keeps each matrix's state"):
        save_param_shards("unused", sharded, wrapped)
    # Ranks that wrap different matrices plan different owners: the same sentence on all.
    matrices = split(gpt())[0][: 8 - rank]
    with pytest.raises(ValueError, match="matrix-owner plan differs across ranks"):
        MatrixOptimizer(torch.optim.Muon(matrices))
