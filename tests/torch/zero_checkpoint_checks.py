"""Spawned checks of ZeroRedundancyOptimizer's resharding checkpoints.

They run inside the world-size workers of ``test_zero.py`` (one spawn per world size): 4
ranks save after 10 steps and resume bitwise; 2 and 3 ranks load that checkpoint (into
ZeRO-1 and ZeRO-2) and continue exactly as a plain Adam loaded with the consolidated state;
2 ranks also feed it damaged and mismatched checkpoints, and save and load a model with a
parameter that has no optimizer state yet.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import read_manifest
from gradsync_core.checkpoint import MANIFEST, rank_file, write_manifest
from gradsync_torch import ZeroRedundancyOptimizer
from tests.torch.zero_helpers import Pair, batch, make_model, plain, zero

ADAM = {"lr": 1e-2}


def _ref_path(directory: str, tag: str) -> str:
    return os.path.join(directory, f"{tag}.reference.pt")


def check_save_resume(world_size: int, directory: str) -> None:
    """Save after 10 steps; a fresh model and optimizer that load it continue bitwise as
    the uninterrupted run. Also leaves ``z1``/``z2`` (and their consolidated torch state)
    for the resharding checks."""
    rank = dist.get_rank()
    for shard in (False, True):
        tag = "z2" if shard else "z1"
        path = os.path.join(directory, tag)
        run = Pair(
            world_size,
            zero(torch.optim.Adam, **ADAM, shard_gradients=shard),
            plain(torch.optim.Adam, **ADAM),
        )
        for _ in range(10):
            run.step()
        run.opt.save(path)
        assert sorted(os.listdir(path)) == sorted(
            [MANIFEST] + [rank_file(r, world_size) for r in range(world_size)]
        )
        run.opt.consolidate_state_dict(to=0)
        if rank == 0:
            reference = {"model": run.model.state_dict(), "optim": run.opt.state_dict()}
            torch.save(reference, _ref_path(directory, tag))
        # "Restart": new objects, a wrong learning rate that the checkpoint must overwrite.
        model = make_model()
        model.load_state_dict(run.model.state_dict())
        resumed = Pair(
            world_size,
            lambda m, shard=shard: ZeroRedundancyOptimizer(
                m.named_parameters(), torch.optim.Adam, lr=5.0, shard_gradients=shard
            ),
            plain(torch.optim.Adam, **ADAM),
            model=model,
            step_index=10,
        )
        resumed.ref = run.ref  # both runs now follow the same plain Adam
        resumed.opt.load(path)
        assert resumed.opt.steps == 10
        assert resumed.opt.param_groups[0]["lr"] == ADAM["lr"]
        for _ in range(10):
            run.step()  # steps the shared reference once
            resumed.opt.zero_grad()
            resumed.backward()
            resumed.opt.step()
            resumed.step_index += 1
            for (name, a), b in zip(
                resumed.model.named_parameters(), run.model.parameters(), strict=True
            ):
                assert torch.equal(a, b), f"resumed run differs at {name}"
        resumed.check_state()
    dist.barrier()  # rank 0's reference files exist before anyone returns


def check_reshard(world_size: int, directory: str) -> None:
    """Load what 4 ranks saved, into ZeRO-1 and ZeRO-2: the state equals the consolidated
    one bitwise, and training continues exactly as a plain Adam loaded with it."""
    for tag in ("z1", "z2"):
        reference = torch.load(_ref_path(directory, tag), weights_only=True)
        for shard in (False, True):
            model = make_model()
            model.load_state_dict(reference["model"])
            pair = Pair(
                world_size,
                lambda m, shard=shard: ZeroRedundancyOptimizer(
                    m.named_parameters(), torch.optim.Adam, lr=5.0, shard_gradients=shard
                ),
                lambda m: torch.optim.Adam(m.parameters(), lr=5.0),
                model=model,
                step_index=10,
            )
            pair.opt.load(os.path.join(directory, tag))
            pair.ref.load_state_dict(copy.deepcopy(reference["optim"]))
            assert pair.opt.steps == 10
            exact, pair.exact = pair.exact, True
            pair.check_state()  # the loaded state is the saved one, bitwise
            pair.exact = exact
            for _ in range(4):
                pair.step()
            pair.check_state()


def _snapshot(opt: ZeroRedundancyOptimizer) -> list[Any]:
    return [
        (p.index, p.start, {k: v.clone() for k, v in opt.optim.state[p.tensor].items()})
        for p in opt.layout.pieces
    ] + [opt.steps, opt.param_groups[0]["lr"]]


def _damage(source: str, target: str, how: str) -> None:
    shutil.copytree(source, target)
    if how == "no manifest":
        os.unlink(os.path.join(target, MANIFEST))
    elif how == "corrupt file":
        with open(os.path.join(target, rank_file(1, 4)), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif how == "missing file":
        os.unlink(os.path.join(target, rank_file(2, 4)))
    elif how == "bad manifest":
        with open(os.path.join(target, MANIFEST), "r+b") as f:
            f.truncate(100)
    elif how == "dropped key":  # a consistent manifest, valid checksum, one key short
        manifest = read_manifest(target, verify_files=False)
        keys = dict(manifest.state_keys)
        keys["3.weight"] = tuple(k for k in keys["3.weight"] if k != "exp_avg_sq")
        write_manifest(target, dataclasses.replace(manifest, state_keys=keys))


DAMAGE = {
    "no manifest": r"has no manifest\.json: not a gradsync checkpoint",
    "corrupt file": r"rank-00001-of-00004\.safetensors does not match its manifest hash",
    "missing file": r"rank-00002-of-00004\.safetensors is missing",
    "bad manifest": r"manifest\.json is corrupt",
    "dropped key": r"the state of '3\.weight' saved by 'torch\.optim\.Adam' holds "
    r"\['exp_avg', 'step'\], but 'torch\.optim\.Adam' keeps \['exp_avg', 'exp_avg_sq', "
    r"'step'\]: it lacks 'exp_avg_sq'",
}


def check_bad_checkpoints(world_size: int, directory: str) -> None:
    """Damaged or mismatched checkpoints fail on every rank with one clear sentence and
    leave the optimizer exactly as it was (it then trains on as if nothing happened)."""
    rank = dist.get_rank()
    source = os.path.join(directory, "z1")
    bad = os.path.join(directory, f"bad-{world_size}")
    if rank == 0:
        for how in DAMAGE:
            _damage(source, os.path.join(bad, how.replace(" ", "-")), how)
    dist.barrier()
    pair = Pair(world_size, zero(torch.optim.Adam, **ADAM), plain(torch.optim.Adam, **ADAM))
    for _ in range(3):
        pair.step()
    before = _snapshot(pair.opt)

    def rejects(opt: ZeroRedundancyOptimizer, path: str, pattern: str) -> None:
        with pytest.raises(ValueError, match=r"cannot load optimizer checkpoint .*" + pattern):
            opt.load(path)

    for how, pattern in DAMAGE.items():
        rejects(pair.opt, os.path.join(bad, how.replace(" ", "-")), pattern)
    rejects(pair.opt, source + "-nowhere", "has no manifest")
    other_opt = ZeroRedundancyOptimizer(pair.model.named_parameters(), torch.optim.AdamW, lr=1)
    rejects(
        other_opt,
        source,
        r"optimizer 'torch\.optim\.Adam', this one is "
        r"'torch\.optim\.AdamW'; load it with the same optimizer class",
    )
    other_model = make_model()
    other_model[3] = nn.Linear(32, 25)
    other_model[5] = nn.Linear(25, 8)
    rejects(
        ZeroRedundancyOptimizer(other_model.named_parameters(), torch.optim.Adam, lr=1),
        source,
        r"parameter '3\.weight' is \(25, 32\) float32 here but \(24, 32\) float32 "
        r"in the checkpoint: another model\?",
    )
    groups = [
        {"params": list(pair.model.named_parameters())[:2]},
        {"params": list(pair.model.named_parameters())[2:]},
    ]
    rejects(ZeroRedundancyOptimizer(groups, torch.optim.Adam, lr=1), source, r"param groups differ")
    after = _snapshot(pair.opt)
    assert len(before) == len(after) and before[-2:] == after[-2:]
    for (i, s, a), (j, t, b) in zip(before[:-2], after[:-2], strict=True):
        assert (i, s) == (j, t) and sorted(a) == sorted(b)
        assert all(torch.equal(a[k], b[k]) for k in a), "a failed load changed the state"
    for _ in range(2):
        pair.step()  # still in lockstep with the plain optimizer: nothing was touched

    # A save that fails on one rank fails on all (no hang) and writes no manifest.
    odd = os.path.join(directory, f"odd-{world_size}")
    state = pair.opt.optim.state[pair.opt.layout.pieces[0].tensor]
    if rank == world_size - 1:
        state["note"] = {"not": "a number"}
    with pytest.raises(
        ValueError,
        match=rf"cannot save .*\(rank {world_size - 1}\): cannot save "
        r"state 'note' of .*: not a number",
    ):
        pair.opt.save(odd)
    state.pop("note", None)
    assert not os.path.exists(os.path.join(odd, MANIFEST))

    # Without names, save and load take them from the model.
    model = make_model()
    unnamed = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, **ADAM)
    with pytest.raises(
        ValueError,
        match=r"no parameter names: build it from "
        r"model\.named_parameters\(\) or pass model=",
    ):
        unnamed.save(os.path.join(directory, "unnamed"))
    unnamed.load(source, model=model)
    assert unnamed.steps == 10
    unnamed.save(os.path.join(directory, "unnamed"), model=model)
    check_unused_parameter(world_size, directory)


def check_unused_parameter(world_size: int, directory: str) -> None:
    """A trainable parameter that never received a gradient has no Adam state; the manifest
    still lists it (with no state keys), so the checkpoint loads, at ZeRO-1 and ZeRO-2."""
    for shard in (False, True):
        path = os.path.join(directory, f"unused-{world_size}-{int(shard)}")
        model = make_model()
        model.register_parameter("unused", nn.Parameter(torch.ones(5)))  # not in forward
        opt = ZeroRedundancyOptimizer(
            model.named_parameters(), torch.optim.Adam, **ADAM, shard_gradients=shard
        )
        for step in range(2):
            x, y = batch(step, 1, 0)  # the same batch on every rank: no averaging needed
            opt.zero_grad()
            ((model(x) - y) ** 2).mean().backward()
            opt.step()
        opt.save(path)
        manifest = read_manifest(path)
        assert manifest.state_keys["unused"] == ()
        assert set(manifest.state_keys["0.weight"]) == {"exp_avg", "exp_avg_sq", "step"}
        assert manifest.extra["scalars"]["0.weight/step"] == 2  # a JSON number (version 2)
        fresh = ZeroRedundancyOptimizer(
            model.named_parameters(), torch.optim.Adam, lr=5.0, shard_gradients=shard
        )
        fresh.load(path)
        assert fresh.steps == 2 and fresh.param_groups[0]["lr"] == ADAM["lr"]
        for mine, theirs in zip(fresh.layout.pieces, opt.layout.pieces, strict=True):
            loaded, saved = fresh.optim.state[mine.tensor], opt.optim.state[theirs.tensor]
            assert sorted(loaded) == sorted(saved)
            assert all(torch.equal(torch.as_tensor(loaded[k]), saved[k]) for k in saved)
