"""One checkpoint for ZeRO-3: a ``fully_shard``-ed model saved at N ranks continues exactly at M
ranks, in ZeRO-1, in a plain torch optimizer and in JAX, and back (docs/torch-zero3.md).

The model is ``TiedLM`` (tests/parity): an 11-row embedding tied to the output head (11 rows
over 2 ranks are 6 + 5, over 4 ranks 3 + 3 + 3 + 2) and a frozen layer. Every run trains
AdamW on one 24-token batch split over the ranks. ``reference`` is the run that never
stopped, in one process; the continued runs are compared with it after further steps
(parameters, both Adam moments, the step count).

- **Bitwise**: ZeRO-3 at 2 ranks saved and loaded at 2 ranks is the 2-rank run that never
  stopped (the same arithmetic after the load: the state is the same bytes); so is a 2-row
  layer saved and loaded at 4 ranks, two of which hold no rows.
- **Reduction-order floor** (``RTOL`` of tests/parity/mlp_twin.py: 1e-5 relative
  for parameters, 5e-5 for moments, 4x the floor measured there): every other pair, since the
  gradient sums run over 1, 2 or 4 ranks or in XLA; a wrong row, key or step count errs by
  1e-2 or more.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tests.parity.tied_worker import TiedLM
from tests.parity.zero3_worker import HYPER, KEYS
from tests.parity.zero3_worker import reference as _reference  # this file's names for them
from tests.parity.zero3_worker import sharded as _sharded
from tests.parity.zero3_worker import state_of as _state
from tests.parity.zero3_worker import train as _train
from tests.support.harness import run_workers

pytestmark = pytest.mark.slow

SAVE_AT, MORE = 3, 2  # save after 3 steps, continue 2 (the JAX leg: 2 more after that)


def _locals(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.to_local()
        for key, value in opt.state.get(p, {}).items():
            out[f"{name}/{key}"] = value.to_local() if hasattr(value, "to_local") else value
    return out


def _zero1(seed: int, path: str | None = None):
    from gradsync_torch import DataParallel, ZeroRedundancyOptimizer

    torch.manual_seed(seed)
    model = TiedLM()
    dp = DataParallel(model)
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.AdamW, **HYPER)
    if path is not None:
        opt.load(path, model=model)
    return model, dp, opt


def _zero1_state(model: nn.Module, opt) -> dict[str, Any]:
    opt.consolidate_state_dict(to=0)
    if torch.distributed.get_rank() != 0:
        return {}
    names = [name for name, _ in model.named_parameters()]
    state = opt.state_dict()["state"]
    return {
        "params": {n: p.detach().numpy().copy() for n, p in model.named_parameters()},
        "state": {f"{names[i]}/{k}": s[k].numpy().copy() for i, s in state.items() for k in KEYS},
        "steps": {names[i]: float(s["step"]) for i, s in state.items()},
    }


def _save_resume_bitwise(path: str, make, tokens, labels, rank: int, world_size: int):
    """Train, save at SAVE_AT, train MORE; a fresh ``make(1234)`` loads the save and trains
    MORE: both end on the same bytes (the same arithmetic). Returns the uninterrupted run."""
    from gradsync_torch import load_param_shards, save_param_shards

    model, opt = make(0)
    _train(model, opt, tokens, labels, SAVE_AT, rank, world_size)
    save_param_shards(path, model, opt)
    _train(model, opt, tokens, labels, MORE, rank, world_size)
    resumed, resumed_opt = make(1234)
    load_param_shards(path, resumed, resumed_opt)
    _train(resumed, resumed_opt, tokens, labels, MORE, rank, world_size)
    mine, theirs = _locals(resumed, resumed_opt), _locals(model, opt)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    return model, opt


def _two_ranks(rank: int, world_size: int, tokens, labels, root: str) -> dict[str, Any]:
    """ZeRO-3 saved and resumed at 2 ranks (bitwise), ZeRO-3 -> ZeRO-1 and ZeRO-1 -> ZeRO-3;
    a refused load changes nothing. Returns (rank 0) each continued run's state."""
    from gradsync_torch import load_optimizer_state_dict, load_param_shards

    z3, z1 = os.path.join(root, "z3"), os.path.join(root, "z1")
    model, opt = _save_resume_bitwise(z3, _sharded, tokens, labels, rank, world_size)
    out = {"uninterrupted": _state(model, opt)}

    wrong, _ = _sharded(1234)
    sgd = torch.optim.SGD(wrong.parameters(), lr=0.1, momentum=0.9)
    before = _locals(wrong, sgd)
    with pytest.raises(ValueError, match=r"cannot load optimizer checkpoint .*optimizer"):
        load_param_shards(z3, wrong, sgd)
    assert all(torch.equal(v, before[k]) for k, v in _locals(wrong, sgd).items())
    with pytest.raises(ValueError, match=r"DTensors .*call load_param_shards"):
        load_optimizer_state_dict(z3, sgd, wrong)  # the plain loader, on sharded parameters

    into1, dp, opt1 = _zero1(1234, z3)  # ZeRO-3 -> ZeRO-1 at 2 ranks
    _train(dp, opt1, tokens, labels, MORE, rank, world_size)
    out["z3_to_z1"] = _zero1_state(into1, opt1)

    from1, dp, opt1 = _zero1(0)  # ZeRO-1 -> ZeRO-3 at 2 ranks
    _train(dp, opt1, tokens, labels, SAVE_AT, rank, world_size)
    opt1.save(z1, model=from1)
    into3, opt3 = _sharded(1234)
    load_param_shards(z1, into3, opt3)
    _train(into3, opt3, tokens, labels, MORE, rank, world_size)
    out["z1_to_z3"] = _state(into3, opt3)
    return out if rank == 0 else {}


def _empty_chunks(rank: int, root: str) -> None:
    """A layer with 2 rows over 4 ranks (ranks 2 and 3 hold none) saves and resumes bitwise,
    its step counts on the empty ranks included."""
    from gradsync_torch import fully_shard, load_param_shards, save_param_shards

    def build(seed: int):
        torch.manual_seed(seed)
        model = fully_shard(nn.Linear(3, 2))
        return model, torch.optim.AdamW(model.parameters(), **HYPER)

    def steps(model, opt, count: int) -> None:
        for step in range(count):
            opt.zero_grad()
            model(torch.full((4, 3), float(rank + step))).square().mean().backward()
            opt.step()

    model, opt = build(0)
    steps(model, opt, 2)
    path = os.path.join(root, "small")
    save_param_shards(path, model, opt)
    again, again_opt = build(1)
    load_param_shards(path, again, again_opt)
    mine, theirs = _locals(again, again_opt), _locals(model, opt)
    assert mine.keys() == theirs.keys()
    for key, value in theirs.items():
        assert torch.equal(mine[key], value), key
    assert again.weight.to_local().shape == ((1, 3) if rank < 2 else (0, 3))


def _hsdp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync_torch import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(seed)
    model = TiedLM()
    for module in (*model.layers, model.frozen, model):
        fully_shard(module, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), **HYPER)


def _hsdp_checkpoint(rank: int, world_size: int, tokens, labels, root: str) -> dict[str, Any]:
    """HSDP 2 x 2 saved (by replica 0) and resumed by HSDP 2 x 2 (bitwise), and by 1-D ZeRO-3
    at 4 ranks; returns both continued runs' states for the floor check."""
    from gradsync_torch import load_param_shards

    path = os.path.join(root, "hsdp")
    model, opt = _save_resume_bitwise(path, _hsdp, tokens, labels, rank, world_size)
    into, into_opt = _sharded(1234)
    load_param_shards(path, into, into_opt)
    _train(into, into_opt, tokens, labels, MORE, rank, world_size)
    return {"hsdp": _state(model, opt), "hsdp_to_1d": _state(into, into_opt)}


def _four_ranks(rank: int, world_size: int, tokens, labels, root: str) -> dict[str, Any]:
    """ZeRO-3 saved at 2 ranks, and JAX's save, each continued by ZeRO-3 at 4 ranks; a
    layer smaller than the world saved and resumed at 4; an HSDP 2 x 2 save."""
    from gradsync_torch import load_param_shards

    _empty_chunks(rank, root)
    out = _hsdp_checkpoint(rank, world_size, tokens, labels, root)
    for name, more in (("z3", MORE), ("jax", MORE)):
        model, opt = _sharded(1234)
        load_param_shards(os.path.join(root, name), model, opt)
        _train(model, opt, tokens, labels, more, rank, world_size)
        out[name] = _state(model, opt)
    return out if rank == 0 else {}


def _close(got: dict[str, Any], want: dict[str, Any], what: str) -> None:
    from tests.parity.mlp_twin import RTOL
    from tests.support.asserts import assert_close

    for part in ("params", "state"):
        try:
            assert_close(got[part], want[part], RTOL[part], part)
        except AssertionError as e:
            raise AssertionError(f"{what}: {e}") from None
    assert got["steps"] == want["steps"], (what, got["steps"], want["steps"])


def test_zero3_checkpoint_round_trips(tmp_path, capsys) -> None:
    """ZeRO-3 2 -> ZeRO-3 2 (bitwise), 2 -> 4, -> ZeRO-1, -> plain torch, -> JAX; ZeRO-1 ->
    ZeRO-3; JAX -> ZeRO-3 at 4 ranks; ``gradsync checkpoint inspect`` on the ZeRO-3 save;
    HSDP 2 x 2 -> HSDP 2 x 2 (bitwise), -> ZeRO-3 at 4 ranks, -> plain torch."""
    from gradsync_core import read_manifest
    from gradsync_core.checkpoint import resolve_checkpoint
    from tests.parity import tied_twin as jaxside

    tokens, labels = jaxside.data()
    root = str(tmp_path)
    two = run_workers(_two_ranks, 2, tokens, labels, root)[0]
    at_save, after = _reference(tokens, labels, SAVE_AT), _reference(tokens, labels, SAVE_AT + MORE)
    _close(two["uninterrupted"], after, "ZeRO-3 at 2 ranks, uninterrupted")
    _close(two["z3_to_z1"], after, "ZeRO-3 at 2 ranks -> ZeRO-1 at 2 ranks")
    _close(two["z1_to_z3"], after, "ZeRO-1 at 2 ranks -> ZeRO-3 at 2 ranks")
    _check_plain(os.path.join(root, "z3"), tokens, labels, after)
    _check_inspect(os.path.join(root, "z3"), at_save, capsys)
    _check_jax(jaxside, root, after)

    four = run_workers(_four_ranks, 4, tokens, labels, root)[0]
    _close(four["z3"], after, "ZeRO-3 at 2 ranks -> ZeRO-3 at 4 ranks")
    final = _reference(tokens, labels, SAVE_AT + 2 * MORE)
    _close(four["jax"], final, "ZeRO-3 -> JAX (ZeRO-1, 2 devices) -> ZeRO-3 at 4 ranks")
    _close(four["hsdp"], after, "HSDP 2 x 2, uninterrupted")
    _close(four["hsdp_to_1d"], after, "HSDP 2 x 2 -> ZeRO-3 at 4 ranks")
    hsdp = os.path.join(root, "hsdp")
    assert read_manifest(resolve_checkpoint(hsdp)).world_size == 2  # the shard group's files
    _check_plain(hsdp, tokens, labels, after, "HSDP 2 x 2 -> plain torch AdamW")


def _check_plain(
    path: str, tokens, labels, want: dict[str, Any], what: str = "ZeRO-3 at 2 ranks"
) -> None:
    """ZeRO-3 -> a plain torch AdamW in one process, weights and state."""
    from gradsync_torch import load_model_weights, load_optimizer_state_dict

    torch.manual_seed(1234)
    model = TiedLM()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    load_model_weights(path, model)
    load_optimizer_state_dict(path, opt, model)
    assert model.head.weight is model.embed.weight
    _train(model, opt, tokens, labels, MORE, 0, 1)
    _close(_state(model, opt), want, what if "->" in what else f"{what} -> plain torch AdamW")


def _check_inspect(path: str, at_save: dict[str, Any], capsys) -> None:
    """The same format: ``inspect`` reads it, each rank owns its rows of every trainable
    parameter, the weights are stored (frozen ones too, the tied one once)."""
    from gradsync_core import read_manifest
    from gradsync_core.checkpoint import resolve_checkpoint
    from gradsync_core.cli._main import main

    assert main(["checkpoint", "inspect", path]) == 0
    text = capsys.readouterr().out
    assert "plan: dim0" in text and "model weights: 9 stored" in text, text
    manifest = read_manifest(resolve_checkpoint(path))
    assert manifest.version == 2 and manifest.framework == "torch" and manifest.step == SAVE_AT
    embed = [(s.rank, s.start, s.stop) for s in manifest.plan.shards if s.name == "embed.weight"]
    assert embed == [(0, 0, 6 * 8), (1, 6 * 8, 11 * 8)]  # rows 0-5 and 6-10, padding stripped
    assert (
        "frozen.weight" not in manifest.state_keys and "head.weight" not in manifest.extra["model"]
    )
    assert set(manifest.state_keys) == {k.rpartition("/")[0] for k in at_save["state"]}


def _check_jax(jaxside, root: str, want: dict[str, Any]) -> None:
    """ZeRO-3 -> gradsync_jax: weights with ``load_params``, the state both unsharded (plain
    Optax) and as a ZeRO-1 ``shard_optimizer``; 2 JAX steps match torch's; JAX saves."""
    from gradsync_jax import (
        load_optimizer_state,
        load_params,
        save_optimizer_state,
        shard_optimizer,
        to_torch_state,
    )
    from tests.parity.mlp_twin import jax_moments, optax_moments
    from tests.support.meshes import mesh_of

    path, renames = os.path.join(root, "z3"), jaxside.RENAMES
    trainable, frozen = jaxside.split(load_params(path, jaxside.linen_init(), modules=renames))
    tx = shard_optimizer(jaxside.adamw(), mesh_of(2), partition="greedy")
    state, manifest = load_optimizer_state(path, tx, trainable, modules=renames)
    plain, _ = load_optimizer_state(path, jaxside.adamw(), trainable, modules=renames)
    loaded = jax_moments(tx, state, trainable, "adamw", renames)
    for key, value in optax_moments(plain[0], "adamw", renames).items():
        np.testing.assert_array_equal(value, loaded[key])
    trainable, state = jaxside.train_jax(tx, trainable, frozen, state, MORE)
    got = {
        "params": to_torch_state(jaxside.joined(trainable, frozen), modules=renames),
        "state": jax_moments(tx, state, trainable, "adamw", renames),
        "steps": want["steps"],  # Optax keeps one count; checked through the save below
    }
    _close(got, want, "ZeRO-3 at 2 ranks -> JAX ZeRO-1 at 2 devices")
    model = jaxside.joined(trainable, frozen)
    step = manifest.step + MORE
    out = os.path.join(root, "jax")
    save_optimizer_state(out, tx, state, trainable, step=step, modules=renames, model=model)


def _old_names(rank: int, world_size: int, root: str) -> None:
    """``save_fully_sharded``/``load_fully_sharded``, the deprecated names of
    ``save_param_shards``/``load_param_shards``: each warns once and saves and loads the
    same bytes."""
    import warnings

    from gradsync_core import deprecation
    from gradsync_torch import (
        fully_shard,
        load_fully_sharded,
        load_param_shards,
        save_fully_sharded,
        save_param_shards,
    )

    def build(seed: int):
        torch.manual_seed(seed)
        model = fully_shard(nn.Linear(3, 5))
        return model, torch.optim.AdamW(model.parameters(), **HYPER)

    model, opt = build(0)
    for step in range(2):
        opt.zero_grad()
        model(torch.full((4, 3), float(rank + step))).square().mean().backward()
        opt.step()
    new, old = os.path.join(root, "new"), os.path.join(root, "old")
    deprecation._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        save_param_shards(new, model, opt)
        save_fully_sharded(old, model, opt)
        save_fully_sharded(old, model, opt)
        by_new, by_new_opt = build(1)
        load_param_shards(new, by_new, by_new_opt)
        by_old, by_old_opt = build(2)
        load_fully_sharded(old, by_old, by_old_opt)
        load_fully_sharded(old, by_old, by_old_opt)
    assert [str(w.message) for w in caught if w.category is DeprecationWarning] == [
        "save_fully_sharded is deprecated and will be removed: use save_param_shards",
        "load_fully_sharded is deprecated and will be removed: use load_param_shards",
    ]
    want, got = _locals(model, opt), _locals(by_new, by_new_opt)
    assert want.keys() == got.keys() == _locals(by_old, by_old_opt).keys()
    for key, value in _locals(by_old, by_old_opt).items():
        assert torch.equal(value, got[key]) and torch.equal(value, want[key]), key


@pytest.mark.slow
def test_the_old_save_and_load_names_warn_once_and_act_alike(tmp_path) -> None:
    run_workers(_old_names, 2, str(tmp_path))
