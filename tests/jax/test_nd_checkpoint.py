"""The JAX composition saves under its own layout and loads under another (issue 37 item 3).

``examples/llama_nnx.py``'s ``parallelize`` trains the Llama reference on 8 CPU devices;
``gradsync_jax.checkpoint.save_boxes`` writes its parameters and AdamW state (and the step)
in the cross-layout format gradsync_torch's ``save_boxes`` writes (model space, a ``"dim0"``
plan from the devices' boxes, the layout in the manifest); ``load_boxes`` places it under
another layout, and the run continued there equals the uninterrupted run on one device
within the floor of tests/jax/test_nd_parallel.py (1e-5 of each tensor's largest entry):
the losses of the steps after the load, parameters and both moments. The pairs are every
ordered pair of the three dense compositions of item 2 (HSDP x tp, tp x cp x dp with
sequence parallelism, dp_shard x tp x pp; nd_checkpoint_problem.PAIRS), each layout trained
and saved once; the item's tp x cp x dp trains the tied model, which no pipeline takes (its
"tied-pp" refusal, and the tied checkpoint's under the pipeline, are tested in
tests/jax/test_nd_parallel.py), so the cp layout here trains the dense one. A checkpoint
that 2 JAX processes saved together continues too. A checkpoint of another model is
refused with one sentence before anything is placed or the data position moves. (The tied
cp and MoE ep x pp pairs are in tests/jax/test_nd_parallel.py, saved by those compositions'
own runs.)
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

import gradsync_jax
from examples.llama_config import LlamaConfig
from examples.llama_nnx import Llama, ParallelLlama, parallelize
from gradsync_core import Topology, read_manifest
from tests.jax import nd_checkpoint_multiprocess_worker as multiprocess_worker
from tests.jax.distributed_start import launch
from tests.jax.nd_checkpoint_problem import (
    DENSE,
    LAYOUTS,
    PAIRS,
    RTOL,
    SAVED,
    SEQ,
    STEPS,
    build,
    reference,
    sampler,
    save_after,
    train,
    transformation,
)
from tests.support.asserts import assert_close


def assert_continues(
    par: ParallelLlama, stored: Any, state: Any, losses: list[float], what: str
) -> None:
    """The losses of the steps after the load, parameters and both AdamW moments against the
    uninterrupted run, within the floor."""
    ref_params, ref_state, ref_losses = reference()
    np.testing.assert_allclose(losses, ref_losses[SAVED:], rtol=RTOL, err_msg=f"{what}: losses")
    got_state = par.state_of(state)
    pairs = [
        ("parameters", par.params_of(stored), ref_params),
        ("first moments", got_state[1][0].mu, ref_state[1][0].mu),
        ("second moments", got_state[1][0].nu, ref_state[1][0].nu),
    ]
    for kind, got, want in pairs:
        ours = gradsync_jax.to_torch_state(jax.tree.map(np.asarray, got))
        theirs = gradsync_jax.to_torch_state(want)
        worst = assert_close(ours, theirs, RTOL, f"{what}: {kind}")
        print(f"{what}: {kind} {worst:.1e} from the uninterrupted run")


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The directory each layout's checkpoint is saved in (by the first test that needs it)."""
    return tmp_path_factory.mktemp("jax-nd-checkpoint")


@pytest.mark.slow
def test_the_manifest_records_the_layout_and_each_rank_writes_its_block(saved: Path) -> None:
    manifest = read_manifest(save_after("dp_shard2_tp2", saved))
    sizes, _ = LAYOUTS["dp_shard2_tp2"]
    layout = manifest.extra["layout"]
    assert layout["topology"] == Topology.create(8, **sizes).to_json()
    assert (layout["framework"], layout["model"]) == ("jax", dataclasses.asdict(DENSE))
    assert (manifest.framework, manifest.step, manifest.world_size) == ("jax", SAVED, 8)
    # wq (torch (out, in) = (32, 32)) is column-parallel over tp and cut over dp_shard on its
    # input dim: 4 distinct boxes (dp_replicate's replicas dropped), two blocks of rows (the
    # tp halves), each cut between its 2 boxes' ranks: 4 ranges of 8 rows, 4 writers.
    shards = [s for s in manifest.plan.shards if s.name == "layers.0.attention.wq.weight"]
    assert sorted((s.start, s.stop) for s in shards) == [(i * 256, (i + 1) * 256) for i in range(4)]
    assert len({s.rank for s in shards}) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("saved_under", "loaded_under"), PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS]
)
def test_a_jax_checkpoint_continues_under_another_layout(
    saved_under: str, loaded_under: str, saved: Path
) -> None:
    path = save_after(saved_under, saved)
    par = build(loaded_under)
    stored, state, manifest = par.load(path)
    assert manifest.step == SAVED
    assert manifest.extra["layout"] == build(saved_under).layout
    losses: list[float] = []
    stored, state = train(par, stored, state, range(SAVED, STEPS), losses)
    assert_continues(par, stored, state, losses, f"{saved_under}->{loaded_under}")


@pytest.mark.slow
def test_a_load_that_cannot_be_expressed_refuses_before_changing_anything(saved: Path) -> None:
    """Another model's layout, and a layout the model cannot take: one sentence each, before
    anything is placed or the data position moves; then the right load moves it."""
    path = save_after("dp_shard2_tp2", saved)
    data = sampler()
    start = data.state_dict()
    deeper = LlamaConfig(**{**DENSE.__dict__, "n_layers": 3})
    sizes, options = LAYOUTS["dp4_tp2"]
    par = parallelize(
        Llama(deeper, rngs=nnx.Rngs(1)),
        Topology.create(8, **sizes),
        options,
        tx=transformation(),
        seq_len=SEQ,
    )
    with pytest.raises(ValueError, match=r"layers\.2\.") as refused:
        par.load(path, data=data)
    assert "\n" not in str(refused.value)
    print(f"refused: {refused.value}")
    assert data.state_dict() == start
    with pytest.raises(ValueError, match="n_kv_heads 2 is not divisible by tp=4"):
        parallelize(
            Llama(DENSE, rngs=nnx.Rngs(1)),
            Topology.create(8, tp=4),
            tx=transformation(),
            seq_len=SEQ,
        )
    *_, manifest = build("dp4_tp2").load(path, data=data)
    assert data.state_dict() == manifest.extra["data"] != start


@pytest.mark.slow
def test_a_checkpoint_saved_by_several_jax_processes_continues_in_one(tmp_path: Path) -> None:
    """2 processes x 4 devices train and save dp_shard 2 x tp 2 (each process writing its own
    devices' rank files); this one process loads it under dp 4 x tp 2 and continues within
    the floor of the uninterrupted run."""
    launch(multiprocess_worker.__file__, tmp_path)
    path = tmp_path / "dp_shard2_tp2"
    manifest = read_manifest(path)
    assert (manifest.world_size, manifest.step) == (8, SAVED)
    assert manifest.extra["layout"] == build("dp_shard2_tp2").layout
    par = build("dp4_tp2")
    stored, state, _ = par.load(path)
    losses: list[float] = []
    stored, state = train(par, stored, state, range(SAVED, STEPS), losses)
    assert_continues(par, stored, state, losses, "2 processes dp_shard2_tp2->dp4_tp2")
