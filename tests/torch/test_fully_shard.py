"""gradsync's ``fully_shard`` (ZeRO-3) against torch's FSDP2 on gloo: after 5 AdamW steps the
parameters, gradients and optimizer state are bitwise equal, and close to one process training
on every rank's batch (docs/torch-zero3.md)."""

import functools
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from tests.support.asserts import assert_tensors_equal as _bitwise  # this file's names for them
from tests.support.harness import run_checks, run_workers
from tests.torch.fsdp_models import UNITS, Net
from tests.torch.fsdp_models import local_shards as _locals

STEPS = 5
MICRO = 4  # micro-steps of the accumulation case


class TiedNet(Net):
    """Net with its head tied to the embedding (GPT-2's tie): both users in the root unit."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(5, 11, bias=False)
        self.head.weight = self.embed.weight


def _build(shard, *, reshard: bool, policy=None, tied: bool = False) -> nn.Module:
    torch.manual_seed(0)
    model = TiedNet() if tied else Net()
    modules = dict(model.named_modules())
    options = {} if policy is None else {"mp_policy": policy}
    for prefix in UNITS:  # bottom-up: inner blocks first
        shard(modules[prefix], reshard_after_forward=reshard, **options)
    shard(model, reshard_after_forward=reshard, **options)
    return model


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randint(0, 11, (3, 4), generator=g)


def _loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).square().mean()


def _train(model: nn.Module, rank: int, *, micro: int = 1) -> tuple[torch.optim.Optimizer, list]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    norms = []
    for step in range(STEPS):
        for m in range(micro):
            model.set_requires_gradient_sync(m == micro - 1)
            _loss(model, _batch(rank, step, m)).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        norms.append(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)
        opt.step()
        if step < STEPS - 1:  # keep the last gradients to compare
            opt.zero_grad()
    return opt, norms


def _reference(rank: int, world_size: int, micro: int, tied: bool) -> nn.Module:
    """One process, no sharding: the mean over ranks (and micro-steps' sum) of the losses."""
    torch.manual_seed(0)
    model = TiedNet() if tied else Net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)
    for step in range(STEPS):
        for m in range(micro):
            loss = sum(_loss(model, _batch(r, step, m)) for r in range(world_size)) / world_size
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        opt.step()
        opt.zero_grad()
    return model


def _check(rank: int, world_size: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TheirPolicy
    from torch.distributed.fsdp import fully_shard as fsdp2

    from gradsync_torch import MixedPrecisionPolicy, fully_shard

    def case(reshard: bool, micro: int = 1, bf16: bool = False, tied: bool = False):
        def check() -> None:
            dtypes = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32} if bf16 else {}
            their_policy = TheirPolicy(**dtypes) if bf16 else None
            theirs = _build(fsdp2, reshard=reshard, policy=their_policy, tied=tied)
            ours = _build(
                fully_shard, reshard=reshard, policy=MixedPrecisionPolicy(**dtypes), tied=tied
            )
            opt_t, norms_t = _train(theirs, rank, micro=micro)
            opt_o, norms_o = _train(ours, rank, micro=micro)
            _bitwise(_locals(theirs, opt_t), _locals(ours, opt_o))
            # The sharded state_dict is FSDP2's too: the same names, DTensors, local pieces.
            mine, fsdp = ours.state_dict(), theirs.state_dict()
            _bitwise(
                {k: v.to_local() for k, v in fsdp.items()},
                {k: v.to_local() for k, v in mine.items()},
            )
            assert all(mine[k].placements == fsdp[k].placements for k in fsdp)
            for a, b in zip(norms_t, norms_o, strict=True):  # clip_grad_norm_'s global norm
                assert torch.equal(a, b), (a, b)
            if bf16:
                return  # bfloat16 compute is not the float32 single-process run
            # Tolerance: the sums' order differs from one process's (a few float32 ulps after
            # 5 Adam steps of lr 0.01); 1e-5 is far below one step's change.
            single = dict(_reference(rank, world_size, micro, tied).named_parameters())
            for name, p in ours.named_parameters():
                torch.testing.assert_close(p.full_tensor(), single[name], rtol=1e-5, atol=1e-5)

        return check

    checks = [
        ("units gather, reduce and free in order", lambda: _lifecycle(rank)),
        ("reshard_after_forward=True", case(True)),
        ("reshard_after_forward=False", case(False)),
        ("accumulation over 4 micro-steps", case(True, micro=MICRO)),
        ("bf16 parameters, fp32 reduction, 2 micro-steps", case(True, micro=2, bf16=True)),
        ("a head tied to the embedding", case(True, tied=True)),
        ("a weight tied across units is refused", _tied_across_units),
        (
            "process_group=, 1-D and (1, N) meshes shard alike; 3-D is refused",
            lambda: _groups(rank),
        ),
        ("plan differs across ranks", lambda: _mismatch(rank)),
        ("the runtime agreement checks twice per step", lambda: _agreement_per_phase(rank)),
    ]
    if world_size == 4:
        checks.append(("HSDP 2 x 2 equals FSDP2's HSDP", lambda: _hsdp(rank)))
    return run_checks(checks)


def _agreement_per_phase(rank: int) -> None:
    """Once a phase is learnt, a step costs two checks (the backward's start and end), with
    accumulation alternating two schedules and an evaluation forward in between; ranks with
    different set_requires_gradient_sync raise one sentence before their backward."""
    from gradsync_torch import fully_shard
    from gradsync_torch.param_sharding import _agreement

    model = _build(fully_shard, reshard=True)
    real, calls = _agreement.agree_on, []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    _agreement.agree_on = counted
    try:
        per_step = []
        for step in range(6):
            if step == 3:  # an evaluation forward: the ranks leave the schedule alike
                with torch.no_grad():
                    model(_batch(rank, step))
            calls.clear()
            model.set_requires_gradient_sync(step % 2 == 1)
            _loss(model, _batch(rank, step)).backward()
            per_step.append(len(calls))
        assert per_step[0] > 2 and per_step[2] == per_step[5] == 2, per_step
        model.set_requires_gradient_sync(rank == 0)
        with pytest.raises(ValueError, match="different set_requires_gradient_sync") as error:
            _loss(model, _batch(rank, 6)).backward()
    finally:
        _agreement.agree_on = real
    sentences: list = [None] * dist.get_world_size()
    dist.all_gather_object(sentences, str(error.value))
    assert len(set(sentences)) == 1, sentences


def _lifecycle(rank: int) -> None:
    """Each unit reduce-scatters as soon as its own backward is done (the innermost last block
    first, the root at the end), and nothing stays gathered after forward or backward."""
    from gradsync_torch import fully_shard

    model = _build(fully_shard, reshard=True)
    units = [m._gradsync_shard_unit for m in model.modules() if hasattr(m, "_gradsync_shard_unit")]
    order = []
    for unit in units:
        reduce = unit.params.reduce_gradients

        def logged(unit=unit, reduce=reduce) -> None:
            order.append((unit.prefix, [u.prefix for u in units if u.params.is_gathered]))
            reduce()

        unit.params.reduce_gradients = logged
    loss = _loss(model, _batch(rank, 0))
    gathered = [u.prefix for u in units if u.params.is_gathered]
    assert gathered == [""], gathered  # only the root stays gathered for the backward
    assert all(u.params.params[0].gathered.untyped_storage().size() == 0 for u in units[1:])
    loss.backward()
    assert order == [
        ("layers.1", ["", "layers.1"]),
        ("layers.0.fc", ["", "layers.0", "layers.0.fc"]),
        ("layers.0", ["", "layers.0"]),
        ("", [""]),
    ], order
    assert not any(u.params.is_gathered for u in units)
    assert all(isinstance(p, nn.Parameter) and isinstance(p, DTensor) for p in model.parameters())


def _groups(rank: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from gradsync_torch import fully_shard

    def by_group(module, **options):
        return fully_shard(module, process_group=dist.group.WORLD, **options)

    world = init_device_mesh("cpu", (dist.get_world_size(),))

    def by_mesh(module, **options):
        return fully_shard(module, mesh=world, **options)

    flat = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("r", "s"))

    def by_flat_mesh(module, **options):  # HSDP with one replica: plain sharding
        return fully_shard(module, mesh=flat, **options)

    a, b = _build(by_group, reshard=True), _build(by_mesh, reshard=True)
    c = _build(by_flat_mesh, reshard=True)
    trained = [_locals(m, _train(m, rank)[0]) for m in (a, b, c)]
    _bitwise(trained[0], trained[1])
    _bitwise(trained[1], trained[2])
    cube = init_device_mesh("cpu", (1, 1, dist.get_world_size()), mesh_dim_names=tuple("abc"))
    with pytest.raises(ValueError, match="2-D one"):
        fully_shard(nn.Linear(2, 2), mesh=cube)


def _hsdp(rank: int) -> None:
    """4 ranks as 2 x 2 (shard within a pair, all-reduce across): bitwise FSDP2's HSDP, with
    the mesh built from a gradsync Topology, and close to one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as fsdp2

    from gradsync_core import Topology
    from gradsync_torch import ProcessGroups, fully_shard, hsdp_mesh

    theirs_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    topology = Topology.create(world_size=4, dp_shard=2)
    ours_mesh = hsdp_mesh(topology)
    assert ours_mesh.mesh.tolist() == theirs_mesh.mesh.tolist()
    # The topology's own process groups give the same 2-D mesh, its dimensions named after
    # the topology's axes; the second run trains on it.
    groups_mesh = ProcessGroups(topology).device_mesh()
    assert groups_mesh.mesh_dim_names == ("dp_replicate", "dp_shard")
    for mesh in (ours_mesh, groups_mesh):
        assert mesh.mesh.tolist() == theirs_mesh.mesh.tolist()
        for dim in range(2):
            assert dist.get_process_group_ranks(mesh.get_group(dim)) == (
                dist.get_process_group_ranks(theirs_mesh.get_group(dim))
            )
    for reshard, mesh in ((True, ours_mesh), (False, groups_mesh)):
        theirs = _build(functools.partial(fsdp2, mesh=theirs_mesh), reshard=reshard)
        ours = _build(functools.partial(fully_shard, mesh=mesh), reshard=reshard)
        opt_t, norms_t = _train(theirs, rank)
        opt_o, norms_o = _train(ours, rank)
        _bitwise(_locals(theirs, opt_t), _locals(ours, opt_o))
        assert all(
            a.placements == b.placements
            for a, b in zip(theirs.parameters(), ours.parameters(), strict=True)
        )
        for a, b in zip(norms_t, norms_o, strict=True):
            assert torch.equal(a, b), (a, b)
    single = dict(_reference(rank, 4, 1, False).named_parameters())
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.full_tensor(), single[name], rtol=1e-5, atol=1e-5)
    # The deprecated spelling (shard_size=) builds the same mesh and warns once.
    from gradsync_core import deprecation

    deprecation._warned.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = hsdp_mesh(Topology.create(world_size=4), shard_size=2)
        hsdp_mesh(Topology.create(world_size=4), shard_size=2)
    assert old.mesh.tolist() == theirs_mesh.mesh.tolist()
    assert [str(w.message) for w in caught] == [
        "hsdp_mesh(topology, shard_size) is deprecated and will be removed: use "
        "hsdp_mesh(Topology.create(..., dp_shard=...))"
    ]
    for dim in range(2):
        assert dist.get_process_group_ranks(old.get_group(dim)) == (
            dist.get_process_group_ranks(ours_mesh.get_group(dim))
        )


def _tied_across_units() -> None:
    from gradsync_torch import fully_shard

    model = TiedNet()
    inner = nn.Linear(5, 11, bias=False)
    inner.weight = model.embed.weight
    model.layers[1].tied = inner  # the embedding's weight is used inside block layers.1 too
    fully_shard(model.layers[1])
    with pytest.raises(NotImplementedError, match="wrap both users of a tied weight in one unit"):
        fully_shard(model)


def _mismatch(rank: int) -> None:
    from gradsync_torch import fully_shard

    model = nn.Sequential(nn.Linear(4, 3 + rank), nn.Linear(3 + rank, 2))
    with pytest.raises(ValueError) as error:
        fully_shard(model)
    message = str(error.value)
    assert "'0.weight'" in message and "rank 1" in message, message
    sentences: list = [None] * dist.get_world_size()
    dist.all_gather_object(sentences, message)
    assert all(s == message for s in sentences), sentences  # the same sentence everywhere


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_fully_shard_equals_fsdp2(world_size):
    for results in run_workers(_check, world_size):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())
