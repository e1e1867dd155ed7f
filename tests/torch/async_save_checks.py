"""Spawned workers of ``test_async_save.py``: saves with ``blocking=False`` on 2 gloo ranks.

Every run trains a ZeRO Adam beside a plain Adam fed the averaged gradients (``Pair``, the
unsharded reference). A save is made with ``blocking=False`` while its background writer is
held at ``before_file`` until training has run further steps (the state changes in place,
and the training's all-reduces run while the writer's collectives do): the checkpoint must
hold the state at the call, bitwise.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core.checkpoint import save_hook
from gradsync_torch import ZeroRedundancyOptimizer, load_optimizer_state_dict
from gradsync_torch._optim_state import RankGroup
from gradsync_torch.checkpoint import save_agreement
from gradsync_torch.checkpoint.staging import STAGING
from tests.support.harness import run_checks
from tests.torch.zero_helpers import Pair, plain, zero

ADAM = {"lr": 1e-2}
SAVED_STEPS, MORE_STEPS = 3, 4


def linear_stack(*sizes: int, seed: int = 0) -> nn.Sequential:
    """Linear layers of widths ``sizes`` with ``Tanh`` between: JAX loads their checkpoint as
    a tree of ``{"kernel", "bias"}`` under the names "0", "2", ..."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for n_in, n_out in itertools.pairwise(sizes):
        layers += [nn.Linear(n_in, n_out), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def linear_model(seed: int = 0) -> nn.Module:
    """Linear layers only, so JAX loads the checkpoint as the tree ``jax_like()``."""
    return linear_stack(16, 32, 24, 8, seed=seed)


def pair(world_size: int, **options: Any) -> Pair:
    return Pair(
        world_size,
        zero(torch.optim.Adam, **ADAM, **options),
        plain(torch.optim.Adam, **ADAM),
        model=linear_model(),
    )


def reference_state(run: Pair) -> dict[str, np.ndarray]:
    """The plain Adam's state by ``"<name>/<key>"`` (``step`` as a 0-d array), a copy."""
    names = [n for n, _ in run.ref_model.named_parameters()]
    out = {}
    for index, state in run.ref.state_dict()["state"].items():
        for key, value in state.items():
            out[f"{names[index]}/{key}"] = value.detach().numpy().copy()
    return out


def weights(model: nn.Module) -> dict[str, np.ndarray]:
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


@contextlib.contextmanager
def held_writer() -> Iterator[threading.Event]:
    """Hold every background writer at ``before_file`` until the event is set (10 s at most)."""
    release = threading.Event()
    with save_hook("before_file", lambda: release.wait(10)):
        try:
            yield release
        finally:
            release.set()


def plain_state(path: str, model: nn.Module | None = None) -> dict[str, np.ndarray]:
    """The checkpoint loaded into a plain torch Adam at world size 1, by ``"<name>/<key>"``."""
    model = linear_model(seed=1) if model is None else model
    opt = torch.optim.Adam(model.parameters(), lr=5.0)
    state_dict = load_optimizer_state_dict(path, opt, model)
    names = [n for n, _ in model.named_parameters()]
    out = {}
    for index, state in state_dict["state"].items():
        for key, value in state.items():
            out[f"{names[index]}/{key}"] = np.asarray(
                value.numpy() if torch.is_tensor(value) else value
            ).copy()
    return out


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> None:
    assert sorted(got) == sorted(want), what
    for key in want:
        assert np.array_equal(np.asarray(got[key], want[key].dtype), want[key]), f"{what}: {key}"


def _save_while_training(run: Pair, path: str, **save: Any) -> tuple[Any, dict, dict]:
    """Save with ``blocking=False``, train ``MORE_STEPS`` (all-reduces included) while the
    writer is held, then let it write; the handle, the state and weights at the call."""
    at_call = reference_state(run), weights(run.ref_model)
    with held_writer() as release:
        handle = run.opt.save(path, blocking=False, **save)
        assert not handle.done()
        for _ in range(MORE_STEPS):
            run.step()
        release.set()
        for _ in range(MORE_STEPS):  # the writer's collectives now, training's beside them
            run.step()
    return handle, *at_call


def api_checks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """ZeRO-1 and ZeRO-2 saves with ``blocking=False``: what each wrote, the staging buffer
    and the background group, per rank."""
    out: dict[str, Any] = {}

    def zero1() -> None:
        run = pair(world_size)
        for _ in range(SAVED_STEPS):
            run.step()
        path = os.path.join(root, "zero1")
        handle, state, _ = _save_while_training(run, path)
        manifest = handle.wait(timeout=60)
        assert manifest.step == SAVED_STEPS and handle.done()
        out["staged state bytes"] = STAGING.nbytes
        buffer = STAGING._buffer
        if rank == 0:
            assert_same(plain_state(path), state, "ZeRO-1 at world size 1")
        # With the model: its weights are staged too, into the same (grown) buffer.
        handle, _, _ = _save_while_training(run, path, model=run.model)
        handle.wait(timeout=60)
        out["staged bytes with weights"] = STAGING.nbytes
        grown = STAGING._buffer
        handle, _, _ = _save_while_training(run, path, model=run.model)
        handle.wait(timeout=60)
        assert STAGING._buffer is grown, "a save of the same bytes allocated a new buffer"
        assert grown is not buffer  # it grew once, for the weights
        out["background groups"] = len(save_agreement._background_groups)
        group = next(iter(save_agreement._background_groups.values()))
        assert group is not dist.group.WORLD
        assert dist.get_process_group_ranks(group) == list(range(world_size))

    def zero2() -> None:
        run = pair(world_size, shard_gradients=True)
        for _ in range(SAVED_STEPS):
            run.step()
        path = os.path.join(root, "zero2")
        handle, state, saved_weights = _save_while_training(run, path, model=run.model)
        assert handle.wait(timeout=60).step == SAVED_STEPS
        if rank == 0:
            assert_same(plain_state(path), state, "ZeRO-2 at world size 1")
        fresh = linear_model(seed=2)
        opt = ZeroRedundancyOptimizer(fresh.named_parameters(), torch.optim.Adam, lr=5.0)
        opt.load(path, model=fresh)  # at the same world size, weights included
        assert_same(weights(fresh), saved_weights, "ZeRO-2 weights")
        assert opt.steps == SAVED_STEPS
        out["background groups after ZeRO-2"] = len(save_agreement._background_groups)

    failures = run_checks([("ZeRO-1", zero1), ("ZeRO-2", zero2)])
    assert all(v is None for v in failures.values()), failures
    return out


def _collectives(group: Any) -> int:
    """How many collectives ``group`` has run (gloo numbers each one it starts)."""
    return group._get_sequence_number_for_group()


def collective_counts(rank: int, world_size: int, root: str) -> dict[str, int]:
    """The collectives one ZeRO-1 save runs, counted by the process groups themselves: a
    background save's on its own group and on the training's, and a blocking save's."""
    run = pair(world_size)
    run.step()
    path = os.path.join(root, "counted")
    run.opt.save(path, blocking=False).wait(timeout=60)  # makes the background group
    (background,) = save_agreement._background_groups.values()
    training = dist.group.WORLD
    before = _collectives(background), _collectives(training)
    run.opt.save(path, blocking=False).wait(timeout=60)
    after = _collectives(background), _collectives(training)
    run.opt.save(path)
    blocking = _collectives(training) - after[1]
    # An answer longer than the slot takes a second all-gather, on every rank alike.
    agreement = save_agreement.RankSaveAgreement(RankGroup(background, rank, world_size))
    before_long = _collectives(background)
    got = agreement.gather({"rank": rank, "text": "x" * save_agreement.SLOT_BYTES * rank})
    want = [{"rank": r, "text": "x" * save_agreement.SLOT_BYTES * r} for r in range(world_size)]
    assert got == want
    return {
        "background": after[0] - before[0],
        "training during a background save": after[1] - before[1],
        "blocking": blocking,
        "a longer answer": _collectives(background) - before_long,
    }


def _sharded_mlp(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    from gradsync_torch import fully_shard

    model = linear_model(seed)
    for i in (0, 2, 4):
        fully_shard(model[i])
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), **ADAM)


def _whole_state(model: nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    """Every parameter's Adam state, whole (``full_tensor``: a collective), by name/key."""
    out = {}
    for name, param in model.named_parameters():
        for key, value in opt.state[param].items():
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            out[f"{name}/{key}"] = value.detach().numpy().copy()
    return out


def param_shards_check(rank: int, world_size: int, root: str) -> dict[str, np.ndarray]:
    """``save_param_shards(blocking=False)`` while training goes on; the state at the call."""
    from gradsync_torch import save_param_shards

    model, opt = _sharded_mlp(0)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 8, generator=gen)
    mine = slice(rank * 4, rank * 4 + 4)

    def step() -> None:
        opt.zero_grad()
        nn.functional.mse_loss(model(x[mine]), y[mine]).backward()
        opt.step()

    for _ in range(SAVED_STEPS):
        step()
    at_call = _whole_state(model, opt)
    with held_writer() as release:
        handle = save_param_shards(os.path.join(root, "zero3"), model, opt, blocking=False)
        for _ in range(MORE_STEPS):
            step()
        release.set()
    handle.wait(timeout=60)
    later = _whole_state(model, opt)
    assert any(not np.array_equal(later[k], at_call[k]) for k in at_call)
    return copy.deepcopy(at_call)


def matrix_check(rank: int, world_size: int, root: str) -> None:
    """``MatrixOptimizer.save(blocking=False)`` (Muon under ZeRO-1) while training goes on:
    a fresh ``MatrixOptimizer`` loads Muon's momentum at the call, bitwise."""
    from tests.torch import matrix_checks as mc

    def momentum(run: dict[str, Any]) -> dict[str, np.ndarray]:  # a collective
        state = run["muon"].full_state()
        return {name: s["momentum_buffer"].numpy().copy() for name, s in state.items()}

    run = mc.build("zero1", world_size)
    mc.train(run, range(SAVED_STEPS), rank, world_size)
    at_call = momentum(run)
    path = os.path.join(root, "muon")
    with held_writer() as release:
        handle = run["muon"].save(path, blocking=False)
        assert not handle.done()
        mc.train(run, range(SAVED_STEPS, SAVED_STEPS + 2), rank, world_size)
        release.set()
    assert handle.wait(timeout=60).step == SAVED_STEPS
    assert any(not np.array_equal(v, at_call[k]) for k, v in momentum(run).items())
    fresh = mc.build("zero1", world_size)
    fresh["muon"].load(path)
    assert_same(momentum(fresh), at_call, "Muon at the call")


def _pipeline(world_size: int) -> tuple[Any, torch.optim.Optimizer]:
    """A GPT of 8 layers in 2 stages (1F1B, pp = world size) and its AdamW."""
    from examples.pipeline_models import gpt_blocks, lm_loss
    from gradsync_core import Topology, plan_pipeline
    from gradsync_torch import ProcessGroups
    from gradsync_torch.pipeline import Pipeline, split_model

    topology = Topology.create(world_size, pp=world_size)
    groups = ProcessGroups(topology)
    plan = plan_pipeline(
        schedule="1F1B", microbatches=2, topology=topology, layers=8, stages_per_rank=1
    )
    split = split_model(gpt_blocks(), plan, groups.group_rank("pp"))
    pipe = Pipeline(plan, split.stages, groups=groups, loss_fn=lm_loss, tied=split.tied)
    return pipe, torch.optim.AdamW(pipe.parameters(), lr=1e-2)


def pipeline_check(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """``save_pipeline(blocking=False)``: returns while rank 0's writer is held and training
    goes on; every rank's handle ends alike, with the manifest, or with one sentence when
    rank 0's write fails. Returns this rank's stages' weights and AdamW state at the call, by
    model name, and the failure each rank heard."""
    from examples.pipeline_models import token_batch
    from gradsync_core import CheckpointError
    from gradsync_torch.pipeline import save_pipeline

    pipe, opt = _pipeline(world_size)

    def train(steps: range) -> None:
        for step in steps:
            tokens, targets = token_batch(4, 8, 32, seed=100 + step)
            pipe.step(tokens, target=targets)
            opt.step()
            opt.zero_grad()

    train(range(SAVED_STEPS))
    at_call = {}
    for module in pipe.stages.values():
        for name, p in module.named_parameters():
            at_call[name] = p.detach().numpy().copy()
            for key, value in opt.state[p].items():
                at_call[f"{name}/{key}"] = value.detach().numpy().copy()
    path = os.path.join(root, "pipeline")
    with held_writer() as release:
        handle = save_pipeline(path, pipe, opt, blocking=False)
        assert not handle.done()  # rank 0 writes; the others wait for its outcome
        train(range(SAVED_STEPS, SAVED_STEPS + 2))
        release.set()
    manifest = handle.wait(timeout=60)

    def full() -> None:
        raise OSError(28, "No space left on device")

    raised = None
    with save_hook("before_file", full):  # only rank 0 writes a file
        failing = save_pipeline(os.path.join(root, "full"), pipe, opt, blocking=False)
        try:
            failing.wait(timeout=60)
        except CheckpointError as e:
            raised = str(e)
    return {"step": manifest.step, "at call": at_call, "raised": raised}
