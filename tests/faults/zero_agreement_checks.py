"""Checks run inside 2 spawned gloo ranks by ``test_zero_agreement.py`` (docs/design.md §15).

Ranks whose ZeroRedundancyOptimizer settings differ get one sentence on every rank naming the
param group, the key and both values (issue 21 item 5): each owner steps its shard with its own
optimizer, so a rank with another lr, class or weight_decay used to diverge silently while the
save recorded rank 0's settings. Forged checkpoint values (a state tensor of the wrong shape or
dtype, NaNs, ``step = -1``, ``lr = NaN``) are refused on every rank before any state changes
(item 4). After each expected error the ranks have issued the same collectives, so one process
group serves every check in turn. No tests of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import safetensors.torch
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import read_manifest
from gradsync_core.checkpoint import save_hook, sha256_file, write_manifest
from gradsync_torch import ZeroRedundancyOptimizer
from gradsync_torch.checkpoint import zero as checkpoint_zero
from tests.torch.dp_grad_checks import expect_error


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _groups(model: nn.Module, decay: float = 0.0) -> list[dict[str, Any]]:
    named = list(model.named_parameters())
    return [
        {"params": [p for n, p in named if n.endswith("weight")]},
        {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": decay},
    ]


def check_optimizer_settings_agree(rank: int, ws: int) -> None:
    """Per-rank lr, Adam vs AdamW, one group's weight_decay: refused at construction."""
    odd = rank == ws - 1
    cases: list[tuple[list[str], Callable[[], object]]] = [
        (
            ["ranks 0 and 1", "param group 0: lr 0.01 vs 0.1"],
            lambda: ZeroRedundancyOptimizer(
                _model().parameters(), torch.optim.Adam, lr=0.1 if odd else 1e-2
            ),
        ),
        (
            ["optimizer torch.optim.Adam vs torch.optim.AdamW"],
            lambda: ZeroRedundancyOptimizer(
                _model().parameters(), torch.optim.AdamW if odd else torch.optim.Adam, lr=1e-2
            ),
        ),
        (
            ["param group 1: weight_decay 0.0 vs 0.5"],
            lambda: ZeroRedundancyOptimizer(
                _groups(_model(), 0.5 if odd else 0.0), torch.optim.Adam, lr=1e-2
            ),
        ),
        (
            ["param group 1: weight_decay 0.0 vs 0.5"],
            lambda: ZeroRedundancyOptimizer(
                _groups(_model(), 0.5 if odd else 0.0),
                torch.optim.Adam,
                lr=1e-2,
                shard_gradients=True,
            ),
        ),
    ]
    for needles, build in cases:
        expect_error(ValueError, needles, build)
    ZeroRedundancyOptimizer(_model().parameters(), torch.optim.Adam, lr=1e-2)  # still in step


def check_add_param_group_agrees(rank: int, ws: int) -> None:
    """An added group with a per-rank lr is refused on every rank."""
    model = _model()
    named = list(model.named_parameters())
    opt = ZeroRedundancyOptimizer([p for _, p in named[:2]], torch.optim.Adam, lr=1e-2)
    lr = 0.5 if rank == ws - 1 else 0.25
    expect_error(
        ValueError,
        ["param group 1: lr 0.25 vs 0.5"],
        lambda: opt.add_param_group({"params": [p for _, p in named[2:]], "lr": lr}),
    )


def check_load_state_dict_agrees(rank: int, ws: int) -> None:
    """A torch-format state dict with a per-rank lr is refused before any state changes."""
    opt = ZeroRedundancyOptimizer(_model().parameters(), torch.optim.Adam, lr=1e-2)
    opt.consolidate_state_dict(to=0)
    state = opt.state_dict() if rank == 0 else None
    box = [state]
    torch.distributed.broadcast_object_list(box, src=0)
    state = box[0]
    if rank == ws - 1:
        state["param_groups"][0]["lr"] = 0.5
    expect_error(ValueError, ["param group 0: lr 0.01 vs 0.5"], lambda: opt.load_state_dict(state))
    assert opt.param_groups[0]["lr"] == 1e-2, "a refused load changed the lr"


def _trained(shard_gradients: bool) -> tuple[nn.Module, ZeroRedundancyOptimizer]:
    model = _model()
    opt = ZeroRedundancyOptimizer(
        model.named_parameters(), torch.optim.Adam, lr=1e-2, shard_gradients=shard_gradients
    )
    for s in range(2):
        torch.manual_seed(s)  # the same batch on every rank: the gradients need no averaging
        model(torch.randn(8, 16)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


Forgery = Callable[[torch.Tensor], torch.Tensor] | None


def _forge(source: str, target: str, forge: Forgery, **extra: Any) -> None:
    """Copy checkpoint ``source`` to ``target`` with ``0.weight``'s ``exp_avg`` replaced by
    ``forge(saved)`` (in each rank file holding it: ZeRO-2 files hold slices) and manifest
    ``extra`` entries changed, the hashes and checksum redone: a file that is well formed but
    holds forged values."""
    shutil.copytree(source, target)
    manifest = read_manifest(target)
    files = dict(manifest.files)
    for name in files:
        path = os.path.join(target, name)
        tensors = safetensors.torch.load_file(path)
        if forge is not None and "0.weight/exp_avg" in tensors:
            tensors["0.weight/exp_avg"] = forge(tensors["0.weight/exp_avg"])
            safetensors.torch.save_file(tensors, path)
            files[name] = sha256_file(path)
    changed = {**manifest.extra}
    for key, value in extra.items():
        changed[key] = value(changed[key])
    write_manifest(target, dataclasses.replace(manifest, files=files, extra=changed))


def _state(opt: ZeroRedundancyOptimizer) -> list[Any]:
    state = [
        (k, v.clone() if torch.is_tensor(v) else v)
        for per_param in opt.optim.state.values()
        for k, v in per_param.items()
    ]
    return [opt.steps, [g["lr"] for g in opt.param_groups], state]


def _same(a: list[Any], b: list[Any]) -> bool:
    return a[:2] == b[:2] and all(
        k == j and (torch.equal(v, w) if torch.is_tensor(v) else v == w)
        for (k, v), (j, w) in zip(a[2], b[2], strict=True)
    )


def _step_scalar(value: dict[str, Any]) -> dict[str, Any]:
    return {k: (-1 if k == "0.weight/step" else v) for k, v in value.items()}


def _nan_lr(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**g, "lr": math.nan} for g in groups]


def check_forged_values_refused(rank: int, ws: int) -> None:
    """ZeRO-1 and ZeRO-2: each forged value fails the load on every rank (naming what is
    wrong) and leaves both ranks' state as it was; NaNs and dtype casts load when asked."""
    box = [tempfile.mkdtemp(prefix="gradsync-forged-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    root = box[0]
    for sg in (False, True):
        model, opt = _trained(sg)
        source = os.path.join(root, f"source-{sg}")
        opt.save(source, model=model)
        cases: dict[str, tuple[Forgery, dict[str, Any], list[str]]] = {
            "shape": (lambda t: torch.zeros(3), {}, ["'0.weight'", "(3,)"]),
            "step": (None, {"scalars": _step_scalar}, ["'0.weight/step'", "step count >= 0"]),
            "lr": (None, {"param_groups": _nan_lr}, ["lr", "numbers finite"]),
            "nan": (lambda t: torch.full_like(t, math.nan), {}, ["NaN", "allow_nonfinite"]),
            "f64": (lambda t: t.double(), {}, ["float64", "float32", "allow_dtype_conversion"]),
        }
        if rank == 0:
            for how, (forge, extra, _) in cases.items():
                _forge(source, os.path.join(root, f"{how}-{sg}"), forge, **extra)
        dist.barrier()
        before = _state(opt)
        for how, (_, _, needles) in cases.items():
            expect_error(
                ValueError,
                ["cannot load optimizer checkpoint", *needles],
                functools.partial(opt.load, os.path.join(root, f"{how}-{sg}"), model=model),
            )
            assert _same(before, _state(opt)), f"a refused load ({how}) changed the state"
        if rank == 0:  # inspect refuses the NaN lr too (it reads the same manifest)
            run = subprocess.run(
                [sys.executable, "-m", "gradsync_core", "checkpoint", "inspect", f"{root}/lr-{sg}"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert run.returncode != 0 and "finite" in run.stderr, (run.returncode, run.stderr)
        opt.load(os.path.join(root, f"nan-{sg}"), model=model, allow_nonfinite=True)
        opt.load(os.path.join(root, f"f64-{sg}"), model=model, allow_dtype_conversion=True)
        if os.path.exists("/proc/self/maps"):  # the loaded state is copied out of the files
            with open("/proc/self/maps") as maps:
                mapped = [line for line in maps if root in line]
            assert not mapped, f"a loaded rank file stays memory-mapped: {mapped[0]}"
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root)


def check_interrupted_save_fails_fast(rank: int, ws: int) -> None:
    """A KeyboardInterrupt while one rank writes its file: that rank raises it, the others a
    sentence naming it at once (not after the process-group timeout), and PATH keeps the
    previous checkpoint."""
    box = [tempfile.mkdtemp(prefix="gradsync-interrupt-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    model, opt = _trained(False)
    opt.save(path, model=model)

    def interrupt() -> None:
        raise KeyboardInterrupt

    start = time.perf_counter()
    with save_hook("before_file", interrupt if rank == ws - 1 else lambda: None):
        try:
            opt.save(path, model=model)
        except KeyboardInterrupt:
            assert rank == ws - 1, "the interrupt reached a rank it was not raised on"
        except ValueError as err:
            assert rank != ws - 1 and "KeyboardInterrupt" in str(err), str(err)
        else:
            raise AssertionError("the interrupted save succeeded")
    assert time.perf_counter() - start < 5, "the save waited for the interrupted rank"
    assert read_manifest(path).step == 2  # the previous checkpoint, whole
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0])


def check_load_racing_a_save(rank: int, ws: int) -> None:
    """A ZeRO load paused after reading version 1's manifest while a save switches PATH to
    version 2 and removes version 1 (issue 21 item 2): the load reads version 1 or fails on
    every rank with "load again", never version 2's state under version 1's manifest; the
    loading optimizer is untouched, and the next load reads version 2 whole."""
    box = [tempfile.mkdtemp(prefix="gradsync-race-") if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    path = os.path.join(box[0], "ckpt")
    model, saver = _trained(False)
    saver.save(path, model=model)  # version 1, step 2
    model(torch.randn(8, 16)).square().mean().backward()
    saver.step()  # step 3: what version 2 holds
    loader = ZeroRedundancyOptimizer(_model().named_parameters(), torch.optim.Adam, lr=1e-2)
    before = _state(loader)
    real = checkpoint_zero.read_manifest

    def read_then_save(directory: Any, **kwargs: Any) -> Any:
        manifest = real(directory, **kwargs)
        saver.save(path, model=model)  # every rank is here: the save is a collective too
        return manifest

    checkpoint_zero.read_manifest = read_then_save
    try:
        needles = ["removed by a later save", "load again"]
        expect_error(ValueError, needles, lambda: loader.load(path))
    finally:
        checkpoint_zero.read_manifest = real
    assert _same(_state(loader), before), "a refused load changed the optimizer"
    loader.load(path)
    assert loader.steps == 3 and _same(_state(loader), _state(saver))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(box[0])


CHECKS: dict[str, Callable[[int, int], None]] = {
    "optimizer_settings_agree": check_optimizer_settings_agree,
    "add_param_group_agrees": check_add_param_group_agrees,
    "load_state_dict_agrees": check_load_state_dict_agrees,
    "forged_values_refused": check_forged_values_refused,
    "interrupted_save_fails_fast": check_interrupted_save_fails_fast,
    "load_racing_a_save": check_load_racing_a_save,
}
