"""The torch side of the cross-framework pipeline tests: ``gradsync_torch.Pipeline`` trains the
GPT of ``examples/pipeline_models.py`` on gloo ranks, under plans made in the test process.

Imported by spawned gloo workers, so it imports torch only (no JAX: faster spawns).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from examples.pipeline_models import gpt_blocks, lm_loss
from gradsync_core import PipelinePlan

# torch.optim.AdamW's twin of optax.adamw(1e-2, b1=0.5, b2=0.75, eps=1e-8, weight_decay=0.1):
# float32 holds the betas' powers exactly, so both bias corrections agree (test_cross_checkpoint)
HYPER = {"lr": 1e-2, "betas": (0.5, 0.75), "eps": 1e-5, "weight_decay": 0.1}
MOMENTS = ("exp_avg", "exp_avg_sq")


def train(
    rank: int,
    world_size: int,
    plans: list[str],
    init: dict[str, np.ndarray],
    batches: list[tuple[np.ndarray, np.ndarray]],
    layers: int,
    save_at: int | None = None,
    save_to: str | None = None,
    load_from: str | None = None,
) -> list[dict[str, Any]]:
    """Train the GPT under each plan (``PipelinePlan.to_json()``), one step per batch, from the
    weights ``init`` (torch names) and, with ``load_from``, the pipeline checkpoint there
    (``load_pipeline``, weights and AdamW state); with ``save_to``, save after ``save_at``
    steps (``save_pipeline``).

    Returns:
        Per plan, this rank's share: ``losses`` (per step, each microbatch's loss; on the
        rank of the last stage, else ``None``), ``grads`` (the first step's gradients, before
        the update), ``params`` and ``state`` (``"<name>/<key>"``) by torch name, and the
        AdamW ``steps`` of its parameters.
    """
    from gradsync_torch import ProcessGroups
    from gradsync_torch.pipeline import Pipeline, load_pipeline, save_pipeline, split_model

    out = []
    groups: dict[str, ProcessGroups] = {}
    for text in plans:
        plan = PipelinePlan.from_json(text)
        key = plan.topology.fingerprint
        if key not in groups:
            groups[key] = ProcessGroups(plan.topology)
        group = groups[key]
        model = gpt_blocks(layers=layers)
        model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in init.items()})
        split = split_model(model, plan, group.group_rank("pp"))
        pipe = Pipeline(plan, split.stages, groups=group, loss_fn=lm_loss)
        opt = torch.optim.AdamW(pipe.parameters(), **HYPER)
        if load_from is not None:
            load_pipeline(load_from, pipe, opt)
        named = [(n, p) for m in split.stages.values() for n, p in m.named_parameters()]
        losses: list[list[float]] | None = []
        grads = {}
        for step, (x, y) in enumerate(batches):
            got = pipe.step(torch.from_numpy(x), target=torch.from_numpy(y))
            if got is None:
                losses = None
            elif losses is not None:
                losses.append([float(loss) for loss in got])
            if step == 0:
                grads = {n: p.grad.numpy().copy() for n, p in named}
            opt.step()
            opt.zero_grad()
            if step + 1 == save_at:
                assert save_to is not None
                save_pipeline(save_to, pipe, opt)
        out.append(
            {
                "losses": losses,
                "grads": grads,
                "params": {n: p.detach().numpy().copy() for n, p in named},
                "state": {
                    f"{n}/{key}": opt.state[p][key].numpy().copy()
                    for n, p in named
                    for key in MOMENTS
                },
                "steps": {n: float(opt.state[p]["step"]) for n, p in named},
            }
        )
    return out
