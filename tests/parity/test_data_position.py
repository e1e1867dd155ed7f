"""The data position crosses frameworks: torch 2 ranks 5 steps, then JAX 4 devices 5 steps,
equals torch 1 rank 10 steps, the data of every step drawn by the samplers
(docs/data-position.md).

The 12-layer MLP, the AdamW twins and the tolerances are tests/parity/mlp_twin.py's (the
tolerance is argued in test_cross_checkpoint.py: 4x the floor that the order of a gradient sum
alone moves). The torch side is tests/torch/resume_worker.py: 100
samples, 24 a step, so 4 steps an epoch and the 10 steps cross two epochs, the save falling
inside the second. The data position travels in a JSON file beside the checkpoint.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_jax import (
    ResumableSampler,
    data_parallel_step,
    load_optimizer_state,
    load_params,
    shard_optimizer,
    to_torch_state,
)
from tests.parity.mlp_twin import (
    RTOL,
    TORCH_HYPER,
    jax_moments,
    linen_init,
    optax_twin,
)
from tests.parity.torch_worker import RENAMES, WIDTHS
from tests.support.asserts import assert_close
from tests.support.harness import run_workers
from tests.support.meshes import mesh_of
from tests.support.models import LinenMLP
from tests.torch import resume_worker

pytestmark = pytest.mark.slow


def test_torch_two_ranks_then_jax_four_devices_equal_torch_one_rank(tmp_path) -> None:
    assert resume_worker.ADAMW == TORCH_HYPER["adamw"]  # optax_twin("adamw") is its twin
    like = linen_init()
    init = to_torch_state(like, modules=RENAMES)
    path = str(tmp_path / "at5")
    run_workers(resume_worker.run, 2, init, 5, path)

    params = load_params(path, like, modules=RENAMES)
    tx = shard_optimizer(optax_twin("adamw"), mesh_of(4), partition="greedy")
    sampler = ResumableSampler(
        resume_worker.SAMPLES, global_batch_size=resume_worker.GLOBAL_BATCH, seed=resume_worker.SEED
    )
    # The position travels in the manifest (torch saved it with data=sampler).
    opt_state, manifest = load_optimizer_state(path, tx, params, modules=RENAMES, data=sampler)
    assert (manifest.framework, manifest.step, manifest.world_size) == ("torch", 5, 2)
    assert manifest.extra["data"] == sampler.state_dict()
    assert (sampler.cursor().epoch, sampler.cursor().consumed) == (1, 24)

    model = LinenMLP(WIDTHS)

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)

    step = data_parallel_step(loss_fn, tx, tx.mesh)
    sharding = NamedSharding(tx.mesh, P("dp"))
    x, y = resume_worker.dataset()
    for indices in itertools.islice(sampler, 5):
        batch = tuple(jax.make_array_from_process_local_data(sharding, a[indices]) for a in (x, y))
        params, opt_state, _ = step(params, opt_state, batch)
    assert (sampler.cursor().epoch, sampler.cursor().consumed) == (2, 48)

    want_model, want_opt = resume_worker.reference(init, 10)
    want_params = {n: p.detach().numpy() for n, p in want_model.named_parameters()}
    want_state = {
        f"{n}/{key}": want_opt.state[p][key].numpy()
        for n, p in want_model.named_parameters()
        for key in ("exp_avg", "exp_avg_sq")
    }
    worst = assert_close(
        to_torch_state(params, modules=RENAMES), want_params, RTOL["params"], "params"
    )
    moments = jax_moments(tx, opt_state, params, "adamw")
    worst = max(worst, assert_close(moments, want_state, RTOL["state"], "state"))
    assert int(tx.gather_state(opt_state, params)[0].count) == 10
    moved = max(float(abs(want_params[k] - init[k]).max()) for k in init)
    assert moved > 1e-2  # it trained
    print(f"torch 2 ranks -> JAX 4 devices vs torch 1 rank: worst relative error {worst:.2e}")
