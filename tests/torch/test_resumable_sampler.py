"""gradsync_torch.ResumableSampler: a DistributedSampler whose position survives a change of
world size (docs/data-position.md)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from gradsync_core import read_manifest
from gradsync_torch import ResumableSampler, load_model_weights, load_optimizer_state_dict
from tests.parity.torch_worker import WIDTHS, TorchMLP
from tests.support.harness import run_workers
from tests.torch import resume_worker

INDICES = TensorDataset(torch.arange(50))  # a batch of it is the sample indices read


def loaders(world_size: int, **kwargs) -> list[tuple[ResumableSampler, DataLoader]]:
    out = []
    for rank in range(world_size):
        sampler = ResumableSampler(INDICES, world_size, rank, seed=3, **kwargs)
        out.append((sampler, DataLoader(INDICES, batch_size=sampler.batch_size, sampler=sampler)))
    return out


def draw(ranks: list[tuple[ResumableSampler, DataLoader]], steps: int) -> list[list[int]]:
    """``steps`` global batches (the ranks' batches concatenated), crossing epochs."""
    batches: list[list[int]] = []
    for epoch in itertools.count(ranks[0][0].epoch):
        for sampler, _ in ranks:
            sampler.set_epoch(epoch)
        for parts in zip(*(loader for _, loader in ranks), strict=True):
            batches.append([int(i) for (part,) in parts for i in part])
            if len(batches) == steps:
                return batches
    raise AssertionError("unreachable")


@pytest.mark.parametrize("last_batch", ["drop", "pad"])
def test_every_world_size_reads_the_same_global_batches(last_batch: str) -> None:
    want = draw(loaders(1, global_batch_size=12, last_batch=last_batch), 13)
    assert all(len(b) == 12 for b in want)
    assert want[0] != want[4]  # a new epoch is another order
    for world_size in (2, 3, 4, 6):
        got = draw(loaders(world_size, global_batch_size=12, last_batch=last_batch), 13)
        assert got == want, world_size


@pytest.mark.parametrize(("before", "after"), [(2, 3), (4, 3), (3, 1)])
def test_a_position_saved_at_one_world_size_resumes_at_another(before: int, after: int) -> None:
    want = draw(loaders(1, global_batch_size=12), 11)
    first = loaders(before, global_batch_size=12)
    got = draw(first, 6)  # into the second epoch (4 steps an epoch)
    states = [sampler.state_dict() for sampler, _ in first]
    assert all(s == states[0] for s in states)  # one position, the same on every rank
    assert (states[0]["epoch"], states[0]["consumed"]) == (1, 24)
    resumed = loaders(after, global_batch_size=12)
    for sampler, _ in resumed:
        sampler.load_state_dict(states[0])
    assert [len(loader) for _, loader in resumed] == [2] * after  # the rest of the epoch
    assert got + draw(resumed, 5) == want


def test_len_and_set_epoch_follow_distributed_sampler() -> None:
    (sampler, loader), _ = loaders(2, global_batch_size=12)
    assert (len(sampler), len(loader), sampler.batch_size) == (24, 4, 6)  # 4 steps, 2 dropped
    assert sampler.epoch == 0
    epoch0 = [b for (b,) in loader]
    # A finished epoch moves the position on (DistributedSampler would repeat the epoch when
    # set_epoch is forgotten); set_epoch(0) still rereads epoch 0.
    assert sampler.epoch == 1 and sampler.state_dict()["consumed"] == 0
    sampler.set_epoch(0)
    assert all(torch.equal(a, b) for a, (b,) in zip(epoch0, loader, strict=True))
    sampler.set_epoch(5)
    first = next(iter(loader))[0]
    sampler.set_epoch(5)  # the same epoch: the position inside it stays
    assert sampler.state_dict()["consumed"] == 12 and len(sampler) == 18
    assert not torch.equal(next(iter(loader))[0], first)


def test_state_at_ignores_what_a_loader_drew_ahead() -> None:
    sampler, loader = loaders(1, global_batch_size=10)[0]
    it = iter(loader)
    next(it), next(it), next(it)  # as if workers had prefetched 3 batches
    assert sampler.state_dict()["consumed"] == 30
    assert sampler.state_at(1)["consumed"] == 10
    assert sampler.state_at(5) == {**sampler.state_dict(), "epoch": 1, "consumed": 0}


def test_bad_arguments_and_positions_are_refused() -> None:
    with pytest.raises(RuntimeError, match="initialized default process group"):
        ResumableSampler(INDICES, global_batch_size=4)
    with pytest.raises(ValueError, match="not a multiple of world_size 4"):
        ResumableSampler(INDICES, 4, 0, global_batch_size=6)
    with pytest.raises(ValueError, match="pass one"):
        ResumableSampler(INDICES, 1, 0, drop_last=True, global_batch_size=4, last_batch="pad")
    pad = ResumableSampler(INDICES, 1, 0, drop_last=False, global_batch_size=4)
    assert pad.plan.last_batch == "pad"
    saved = ResumableSampler(INDICES, 1, 0, global_batch_size=4).state_dict()
    bigger = ResumableSampler(range(60), 2, 1, global_batch_size=4)
    with pytest.raises(ValueError, match="dataset of 50 samples but this one has 60"):
        bigger.load_state_dict(saved)
    with pytest.raises(ValueError, match="build the sampler with seed=0"):
        ResumableSampler(INDICES, 1, 0, seed=1, global_batch_size=4).load_state_dict(saved)
    resized = ResumableSampler(range(60), 2, 1, global_batch_size=4, allow_resize=True)
    resized.load_state_dict(saved)
    assert resized.state_dict()["dataset_size"] == 60


def test_stateful_dataloader_resumes_mid_epoch() -> None:
    stateful = pytest.importorskip(
        "torchdata.stateful_dataloader",
        reason="torchdata is not installed (not a gradsync dependency); StatefulDataLoader "
        "is untested here",
    )
    want = [
        b
        for (b,) in DataLoader(
            INDICES, batch_size=10, sampler=loaders(1, global_batch_size=10)[0][0]
        )
    ]
    loader = stateful.StatefulDataLoader(
        INDICES, batch_size=10, sampler=loaders(1, global_batch_size=10)[0][0]
    )
    it = iter(loader)
    got = [next(it)[0] for _ in range(2)]
    state = loader.state_dict()
    again = stateful.StatefulDataLoader(
        INDICES, batch_size=10, sampler=loaders(1, global_batch_size=10)[0][0]
    )
    again.load_state_dict(state)
    got += [b for (b,) in again]
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


# The floor that tests/parity/test_cross_checkpoint.py justifies for this MLP and AdamW
# (4x what the order of a gradient sum alone moves after 10 steps), relative to each tensor's
# largest magnitude: 4 -> 3 -> 1 ranks sum the same gradients in another order, no more.
RTOL = {"params": 1e-5, "state": 5e-5}


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.abs(got - want).max()) / (float(np.abs(want).max()) or 1.0)


def test_four_ranks_then_three_equal_one_rank(tmp_path) -> None:
    """4 ranks 5 steps, saved (ZeRO state, weights, data position); 3 ranks 5 more steps ==
    1 rank 10 steps with the same data, parameters and both Adam moments."""
    torch.manual_seed(0)
    init = {k: v.detach().numpy() for k, v in TorchMLP(WIDTHS).state_dict().items()}
    first, second = str(tmp_path / "at5"), str(tmp_path / "at10")
    run_workers(resume_worker.run, 4, init, 5, first)
    run_workers(resume_worker.run, 3, None, 5, second, first)
    for path, epoch, consumed in ((first, 1, 24), (second, 2, 48)):  # 4 steps an epoch
        cursor = read_manifest(path).extra["data"]  # saved with data=sampler
        assert (cursor["epoch"], cursor["consumed"]) == (epoch, consumed)
    want_model, want_opt = resume_worker.reference(init, 10)
    net = TorchMLP(WIDTHS)
    load_model_weights(second, net)
    got_opt = torch.optim.AdamW(net.parameters(), **resume_worker.ADAMW)
    load_optimizer_state_dict(second, got_opt, net)
    worst = {"params": 0.0, "state": 0.0}
    for (name, got), want in zip(net.named_parameters(), want_model.parameters(), strict=True):
        error = relative_error(got.detach().numpy(), want.detach().numpy())
        assert error <= RTOL["params"], f"{name}: {error:.2e}"
        worst["params"] = max(worst["params"], error)
        for key in ("exp_avg", "exp_avg_sq"):
            error = relative_error(
                got_opt.state[got][key].numpy(), want_opt.state[want][key].numpy()
            )
            assert error <= RTOL["state"], f"{name}/{key}: {error:.2e}"
            worst["state"] = max(worst["state"], error)
        assert float(got_opt.state[got]["step"]) == 10.0
    moved = max(
        relative_error(p.detach().numpy(), init[n]) for n, p in want_model.named_parameters()
    )
    assert moved > 1e-2  # it trained
    print(f"4 -> 3 ranks vs 1 rank: worst relative error {worst}")
