"""``save_boxes(blocking=False)``: the checkpoint that crosses layouts, saved in the background.

Two gloo ranks lay the Llama reference out at tp 2, train a step, and save with
``blocking=False``; training goes on (another step changes every weight and moment in place)
before the handle's ``wait()``. The checkpoint must hold the state at the call: loaded by
``load_boxes`` into a fresh model under another layout (dp 2), every piece of the weights and
of the AdamW state equals, exactly, what a blocking save of the same state loads.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from examples.llama_config import ParallelOptions
from examples.llama_torch import Llama, ParallelLlama, parallelize
from gradsync_core import Topology
from gradsync_torch.checkpoint import load_boxes, save_boxes
from tests.support.harness import run_workers
from tests.torch.nd_checks import DENSE, LR, SEQ, batches


def _build(sizes: dict[str, int]) -> tuple[ParallelLlama, torch.optim.Optimizer]:
    model = parallelize(
        Llama(DENSE, seed=1).double(), Topology.create(2, **sizes), ParallelOptions(), seq_len=SEQ
    )
    return model, torch.optim.AdamW(list(model.parameters()), lr=LR, foreach=False)


def _step(model: ParallelLlama, opt: torch.optim.Optimizer, i: int) -> None:
    model.step(*batches()[i])
    opt.step()
    opt.zero_grad()


def _loaded(path: str) -> list[torch.Tensor]:
    """Every local tensor of a dp 2 model loaded from ``path``: weights, then AdamW state."""
    model, opt = _build({})
    held = model.held()
    load_boxes(path, held, opt, specs=model.specs())
    out: list[torch.Tensor] = []
    for h in held:
        out.append(h.param.detach().clone())
        state = opt.state[h.param]
        out += [state[k].clone() for k in ("exp_avg", "exp_avg_sq")]
    return out


def _save_in_background(rank: int, ws: int, directory: str) -> list[bool]:
    model, opt = _build({"tp": 2})
    _step(model, opt, 0)
    blocking, background = (os.path.join(directory, n) for n in ("blocking", "background"))
    save_boxes(blocking, model.held(), opt, specs=model.specs())
    handle = save_boxes(background, model.held(), opt, specs=model.specs(), blocking=False)
    _step(model, opt, 1)  # training goes on while the files are written
    manifest = handle.wait()
    assert manifest.step == 1, manifest.step
    want: Any = _loaded(blocking)
    got = _loaded(background)
    return [torch.equal(a, b) for a, b in zip(got, want, strict=True)]


def test_a_background_save_holds_the_state_at_the_call(tmp_path: Any) -> None:
    results = run_workers(_save_in_background, 2, str(tmp_path), timeout=240)
    assert all(all(r) and r for r in results), results
