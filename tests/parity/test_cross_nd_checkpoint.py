"""The JAX composition's checkpoint continues under a torch layout (issue 37 item 3).

examples/llama_nnx.py's ``parallelize`` trains the Llama reference 2 steps under each dense
composition of issue 37 item 2 on 8 CPU devices (HSDP x tp, tp x cp x dp with sequence
parallelism, dp_shard x tp x pp: ``DENSE_COMPOSITIONS``; and the MoE variant under ep x
dp_shard x pp) and saves (``ParallelLlama.save``, the cross-layout format); 4 gloo ranks load
it under torch's tp 2 x pp 2 (the MoE one under ep 2 x dp 2: ``load_boxes``: another layout,
another framework), train 2 more steps, and their pieces of the parameters
and AdamW moments equal torch's uninterrupted run on one process from the same initial
weights within the JAX compositions' floor (1e-5 of each tensor's largest entry: float32, two
frameworks' reduction orders; tests/jax/test_nd_parallel.py measured the twin runs 4.8e-6 apart).
"""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

import gradsync_jax
from examples.llama_config import ParallelOptions
from tests.jax.nd_checkpoint_problem import (
    DENSE,
    DENSE_COMPOSITIONS,
    EPS,
    LR,
    MAX_NORM,
    MODELS,
    RTOL,
    SAVED,
    batches,
    initial_params,
    save_after,
)
from tests.parity.nd_checkpoint_worker import continue_in_torch
from tests.support.harness import run_workers

pytestmark = pytest.mark.slow


# (JAX layout, the torch layout that continues it on 4 ranks)
CONTINUED = [
    *((name, {"tp": 2, "pp": 2}, ParallelOptions(microbatches=2)) for name in DENSE_COMPOSITIONS),
    ("ep2_dp_shard2_pp2_moe", {"ep": 2}, ParallelOptions()),
]


@pytest.mark.parametrize(("name", "sizes", "options"), CONTINUED, ids=[c[0] for c in CONTINUED])
def test_a_jax_checkpoint_continues_under_a_torch_layout(
    name: str, sizes: dict[str, int], options: ParallelOptions, tmp_path: Path
) -> None:
    path = save_after(name, tmp_path)
    cfg = MODELS.get(name, DENSE)
    initial = gradsync_jax.to_torch_state(jax.tree.map(np.asarray, initial_params(cfg)))
    hyper = {"lr": LR, "eps": EPS, "max_norm": MAX_NORM}
    results = run_workers(
        continue_in_torch,
        4,
        str(path),
        cfg,
        sizes,
        options,
        initial,
        batches(cfg),
        SAVED,
        hyper,
        RTOL,
        timeout=300,
    )
    worst = {k: max(r[k] for r in results) for k in results[0]}
    print(f"{name} (JAX) -> {sizes} (torch), relative to torch's uninterrupted run: {worst}")
    assert max(worst.values()) <= RTOL, worst  # each rank checked its own pieces too
