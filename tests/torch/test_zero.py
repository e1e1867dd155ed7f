"""gradsync_torch.ZeroRedundancyOptimizer against the unsharded optimizer, on gloo.

Every check compares with a plain torch optimizer stepping a copy of the model on the same
averaged gradients: parameters after every step and optimizer state at the end, bitwise
(ZeRO-1 runs the same arithmetic on the same inputs). ZeRO-2 sums gradients with gloo's
reduce instead of an all-reduce; at 2 ranks (a mean of two is exact in any order) and 1 rank
that is still bitwise, at 4 ranks it is compared with rtol=1e-5, atol=1e-6. One spawn per
world size runs all checks.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero

import gradsync_core
from gradsync_torch import ZeroRedundancyOptimizer
from gradsync_torch._specs import param_specs
from gradsync_torch.zero import flat as zero_flat
from gradsync_torch.zero import greedy as zero_greedy
from gradsync_torch.zero.broadcast import Job
from gradsync_torch.zero.local_step import (
    FOREACH_SAME_BITS,
    JobStepper,
    foreach_on_cpu_groups,
    steps_per_tensor,
)
from tests.support.harness import run_checks, run_workers
from tests.torch import zero_checkpoint_checks as ckpt
from tests.torch.zero_helpers import (
    Pair,
    make_model,
    plain,
    same,
    zero,
)


@contextlib.contextmanager
def alone_bytes(value: int) -> Iterator[None]:
    """Lower the size from which a parameter is broadcast alone, so small models test it."""
    saved = zero_greedy.ALONE_BYTES
    zero_greedy.ALONE_BYTES = zero_flat.ALONE_BYTES = value
    try:
        yield
    finally:
        zero_greedy.ALONE_BYTES = zero_flat.ALONE_BYTES = saved


OPTIMIZERS = [
    (torch.optim.SGD, {"lr": 0.05, "momentum": 0.9}),
    (torch.optim.Adam, {"lr": 1e-2}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
]


def check_trajectories(world_size: int) -> dict[str, Any]:
    """20 steps of each optimizer, ZeRO-1 and ZeRO-2, equal the unsharded optimizer."""
    finals = {}
    for i, (cls, kw) in enumerate(OPTIMIZERS):
        for shard in (False, True):
            # Vary the layout options too: bucket views, and buckets of a few parameters.
            extra = {
                "shard_gradients": shard,
                "parameters_as_bucket_view": i == 1,
                "bucket_cap_mb": 0.002 if i == 0 else 25.0,
            }
            # AdamW: parameters of >= 256 bytes travel alone, in place (as 1 MiB ones do).
            with alone_bytes(256 if i == 2 else zero_greedy.ALONE_BYTES):
                pair = Pair(world_size, zero(cls, **kw, **extra), plain(cls, **kw))
            for _ in range(20):
                pair.step()
            pair.check_state()
            finals[(cls.__name__, shard)] = [p.detach().clone() for p in pair.model.parameters()]
    for cls, _ in OPTIMIZERS:  # ZeRO-2 equals ZeRO-1
        for a, b in zip(finals[(cls.__name__, False)], finals[(cls.__name__, True)], strict=True):
            same(a, b, world_size <= 2, f"ZeRO-2 vs ZeRO-1 {cls.__name__}")
    return {"runs": len(finals)}


def check_scheduler_closure_groups(world_size: int) -> None:
    for shard in (False, True):
        # An LR scheduler drives param_groups; step(closure) returns the closure's loss.
        pair = Pair(
            world_size,
            zero(torch.optim.Adam, lr=1e-2, shard_gradients=shard),
            plain(torch.optim.Adam, lr=1e-2),
        )
        scheds = [
            torch.optim.lr_scheduler.StepLR(o, step_size=4, gamma=0.5) for o in (pair.opt, pair.ref)
        ]
        for step in range(12):
            pair.step(closure=step % 2 == 1)
            for s in scheds:
                s.step()
        assert pair.opt.param_groups[0]["lr"] == pair.ref.param_groups[0]["lr"] == 1e-2 / 8
        pair.check_state()

        # add_param_group: the head joins after 5 steps with its own learning rate.
        def body(m: nn.Module) -> list[tuple[str, torch.Tensor]]:
            return [(n, p) for n, p in m.named_parameters() if not n.startswith("5.")]

        def make(m: nn.Module, shard: bool = shard) -> ZeroRedundancyOptimizer:
            return ZeroRedundancyOptimizer(
                body(m), torch.optim.AdamW, lr=1e-2, shard_gradients=shard
            )

        pair = Pair(world_size, make, lambda m: torch.optim.AdamW([p for _, p in body(m)], lr=1e-2))
        for step in range(12):
            if step == 5:
                for model, opt in ((pair.model, pair.opt), (pair.ref_model, pair.ref)):
                    head = list(model[5].named_parameters(prefix="5"))
                    group = head if opt is pair.opt else [p for _, p in head]
                    opt.add_param_group({"params": group, "lr": 3e-2})
            pair.step()
        assert len(pair.opt.param_groups) == 2 and pair.opt.param_groups[1]["lr"] == 3e-2
        pair.check_state()


def check_trainability(world_size: int) -> None:
    """ZeRO-1: a parameter frozen at construction and unfrozen later is re-planned (state
    moves to new owners); one frozen later keeps its owner and state, as plain Adam."""
    pair = Pair(world_size, zero(torch.optim.Adam, lr=1e-2), plain(torch.optim.Adam, lr=1e-2))
    for model in (pair.model, pair.ref_model):
        model[0].weight.requires_grad_(False)
    pair.opt = zero(torch.optim.Adam, lr=1e-2)(pair.model)  # built with 0.weight frozen
    owners_before = pair.opt.plan().shards
    for step in range(14):
        if step == 6:
            for model in (pair.model, pair.ref_model):
                model[0].weight.requires_grad_(True)
        if step == 10:
            for model in (pair.model, pair.ref_model):
                model[3].weight.requires_grad_(False)
        pair.step()
    assert pair.opt.plan().shards != owners_before
    assert "0.weight" in {s.name for s in pair.opt.plan().shards}
    pair.check_state()


def check_state_dict_interchange(world_size: int) -> None:
    """The consolidated state_dict loads into a plain Adam that then continues identically,
    and a plain Adam's state_dict loads into the ZeRO optimizer."""
    for shard in (False, True):
        pair = Pair(
            world_size,
            zero(torch.optim.Adam, lr=1e-2, shard_gradients=shard),
            plain(torch.optim.Adam, lr=1e-2),
        )
        for _ in range(6):
            pair.step()
        pair.opt.consolidate_state_dict(to=0)
        box = [pair.opt.state_dict() if pair.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        fresh = copy.deepcopy(pair.model)
        replacement = torch.optim.Adam(fresh.parameters(), lr=5.0)
        replacement.load_state_dict(box[0])
        assert replacement.param_groups[0]["lr"] == 1e-2
        pair.ref_model, pair.ref = fresh, replacement  # plain Adam now continues the ZeRO run
        for _ in range(4):
            pair.step()
        pair.check_state()
        # ... and the other way: a fresh ZeRO optimizer takes the plain Adam's state.
        model = copy.deepcopy(pair.ref_model)
        opt = ZeroRedundancyOptimizer(
            model.named_parameters(), torch.optim.Adam, lr=5.0, shard_gradients=shard
        )
        opt.load_state_dict(copy.deepcopy(pair.ref.state_dict()))  # it returns live tensors
        pair.model, pair.opt = model, opt
        for _ in range(4):
            pair.step()
        pair.check_state()


def check_memory(world_size: int) -> dict[str, float]:
    """Each rank holds Adam state for exactly the parameters the plan gives it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    opt = ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.Adam, lr=1e-3)
    ref = torch.optim.Adam(copy.deepcopy(model).parameters(), lr=1e-3)
    for p in [*model.parameters(), *ref.param_groups[0]["params"]]:
        p.grad = torch.ones_like(p)
    opt.step()
    ref.step()
    unsharded = sum(v.numel() * v.element_size() for s in ref.state.values() for v in s.values())
    owned = opt.plan().rank_numel[opt.rank]
    n_owned = len(opt.plan().shards_of(opt.rank))
    assert opt.state_nbytes() == 2 * 4 * owned + 4 * n_owned  # exp_avg, exp_avg_sq, step
    total = torch.tensor([opt.state_nbytes()])
    dist.all_reduce(total)
    assert total.item() == unsharded
    ratio = opt.state_nbytes() / unsharded
    if world_size == 2:
        assert ratio <= 0.55, ratio
    return {"state_ratio": ratio}


def check_torch_partition(world_size: int) -> None:
    """Ownership equals torch's own ZeroRedundancyOptimizer on a real model, two groups."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Embedding(40, 32),
        nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
        nn.TransformerEncoderLayer(32, 4, 64, batch_first=True),
        nn.Linear(32, 40),
    )
    named = list(model.named_parameters())
    decay = [(n, p) for n, p in named if p.dim() >= 2]
    no_decay = [(n, p) for n, p in named if p.dim() < 2]
    theirs = TorchZero(
        [
            {"params": [p for _, p in decay]},
            {"params": [p for _, p in no_decay], "weight_decay": 0.0},
        ],
        optimizer_class=torch.optim.AdamW,
        lr=1e-3,
    )
    ours = ZeroRedundancyOptimizer(
        [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}],
        torch.optim.AdamW,
        lr=1e-3,
    )
    name_of = {id(p): n for n, p in named}
    torch_owner = {name_of[id(p)]: r for p, r in theirs._param_to_rank.items()}
    plan = gradsync_core.plan_greedy_shards(
        [param_specs(decay), param_specs(no_decay)], world_size=world_size
    )
    assert {s.name: s.rank for s in plan.shards} == torch_owner
    assert ours.plan() == plan
    mine = {name_of[id(p)] for g in ours.optim.param_groups for p in g["params"]}
    assert mine == {name_of[id(p)] for g in theirs.optim.param_groups for p in g["params"]}


def _checks(world_size: int, directory: str) -> list[tuple[str, Callable[[], Any]]]:
    """The checks one worker of ``world_size`` ranks runs, by name, in order."""
    if world_size == 3:  # only resharding: load what 4 ranks saved
        return [("reshard", lambda: ckpt.check_reshard(world_size, directory))]
    checks: list[tuple[str, Callable[[], Any]]] = [
        ("trajectories", lambda: check_trajectories(world_size))
    ]
    if world_size <= 2:
        checks += [
            ("scheduler_closure_groups", lambda: check_scheduler_closure_groups(world_size)),
            ("state_dict_interchange", lambda: check_state_dict_interchange(world_size)),
        ]
    checks += [
        ("trainability", lambda: check_trainability(world_size)),
        ("memory", lambda: check_memory(world_size)),
        ("torch_partition", lambda: check_torch_partition(world_size)),
    ]
    if world_size == 2:
        checks += [
            ("reshard", lambda: ckpt.check_reshard(world_size, directory)),
            ("bad_checkpoints", lambda: ckpt.check_bad_checkpoints(world_size, directory)),
        ]
    else:  # 1 and 4: save, restart, resume; 4 also writes what 2 and 3 load
        checks.append(("save_resume", lambda: ckpt.check_save_resume(world_size, directory)))
    return checks


def worker(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Run every check (``harness.run_checks``; each builds its own model, so ``keep_going``:
    the first failure does not hide the rest) and collect what the checks return (``runs``,
    ``state_ratio``)."""
    values: dict[str, Any] = {}

    def keeping(check: Callable[[], Any]) -> Callable[[], None]:
        return lambda: values.update(check() or {})

    checks = _checks(world_size, directory)
    return {
        "checks": run_checks(((name, keeping(c)) for name, c in checks), keep_going=True),
        **values,
    }


def failures(results: list[dict[str, Any]]) -> list[str]:
    """``"rank R: check: error"`` for every check that failed on any rank."""
    return [
        f"rank {rank}: {name}: {error}"
        for rank, result in enumerate(results)
        for name, error in result["checks"].items()
        if error is not None
    ]


@pytest.fixture(scope="module")
def saved_at_4(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], str]:
    directory = str(tmp_path_factory.mktemp("zero"))
    return run_workers(worker, 4, directory, timeout=400), directory


@pytest.mark.slow
def test_world4_trajectories_partition_save_resume(saved_at_4: tuple[list[Any], str]) -> None:
    results, _ = saved_at_4
    assert failures(results) == []
    expected = {"trajectories", "trainability", "memory", "torch_partition", "save_resume"}
    assert all(set(r["checks"]) == expected for r in results)
    assert [r["runs"] for r in results] == [6] * 4


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3], ids=lambda w: f"world{w}")
def test_resharded_resume_and_more(world_size: int, saved_at_4: tuple[list[Any], str]) -> None:
    results = run_workers(worker, world_size, saved_at_4[1], timeout=400)
    assert failures(results) == []


@pytest.mark.slow
def test_world1(tmp_path: Any) -> None:
    results = run_workers(worker, 1, str(tmp_path))
    assert failures(results) == []
    assert results[0]["runs"] == 6


def test_zero2_rejects_non_elementwise_optimizers() -> None:
    with pytest.raises(ValueError, match=r"elementwise.*Adafactor.*shard_gradients=False"):
        ZeroRedundancyOptimizer(
            make_model().parameters(), torch.optim.Adafactor, shard_gradients=True
        )


def test_needs_an_initialized_process_group() -> None:
    with pytest.raises(RuntimeError, match="init_process_group"):
        ZeroRedundancyOptimizer(make_model().parameters(), torch.optim.Adam)


# Every option of each optimizer ZeRO's local step switches to foreach, as torch 2.13 names it.
FOREACH_VARIANTS = {
    "SGD": [
        {"lr": 0.1},
        {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01, "dampening": 0.1},
        {"lr": 0.1, "momentum": 0.9, "nesterov": True, "maximize": True},
    ],
    "Adam": [{}, {"weight_decay": 0.01, "amsgrad": True, "maximize": True}],
    "AdamW": [{}, {"amsgrad": True, "maximize": True, "weight_decay": 0.1}],
    "Adamax": [{}, {"weight_decay": 0.01, "maximize": True}],
    "RMSprop": [{}, {"centered": True, "momentum": 0.9, "weight_decay": 0.01, "maximize": True}],
    "Adagrad": [{}, {"weight_decay": 0.01, "lr_decay": 0.01, "maximize": True}],
    "Adadelta": [{}, {"weight_decay": 0.01, "maximize": True}],
    "Rprop": [{}, {"maximize": True}],
}


@pytest.mark.parametrize("name", sorted(FOREACH_SAME_BITS))
def test_foreach_path_gives_the_loops_bits(name: str) -> None:
    """The local step switches these to foreach on CPU because it is bitwise the per-tensor
    loop; a torch release that rounds differently fails here, not as a silent last-bit drift."""
    assert set(FOREACH_VARIANTS) == FOREACH_SAME_BITS
    for options in FOREACH_VARIANTS[name]:
        finals = []
        for foreach in (False, True):
            gen = torch.Generator().manual_seed(0)
            shapes = [(7, 5), (5,), (33,), (1,)]
            params = [torch.randn(s, generator=gen, requires_grad=True) for s in shapes]
            optim = getattr(torch.optim, name)(params, foreach=foreach, **options)
            for step in range(4):  # gradients from 1e-2 to 10: tiny and large moments
                for p in params:
                    p.grad = torch.randn(p.shape, generator=gen) * 10.0 ** (step - 2)
                optim.step()
            finals.append([p.detach().clone() for p in params])
        assert all(torch.equal(a, b) for a, b in zip(*finals, strict=True)), (name, options)


def test_job_stepper_steps_exactly_each_jobs_parameters() -> None:
    """Stepping job by job (ZeRO-1/2's overlap of the local step with the sync) equals one
    step of every parameter, bitwise, and a job's step leaves the other jobs' untouched."""
    model, reference = make_model(), make_model()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        p.grad = torch.full_like(p, 0.5) + p.detach()
        q.grad = p.grad.clone()
    params = list(model.parameters())
    optim = torch.optim.Adam([{"params": params[:3]}, {"params": params[3:], "lr": 0.1}])
    ref_params = list(reference.parameters())
    plain = torch.optim.Adam([{"params": ref_params[:3]}, {"params": ref_params[3:], "lr": 0.1}])
    jobs = [Job([], 0, torch.float32, torch.device("cpu"), owned=params[i::2]) for i in (0, 1)]
    stepper = JobStepper(optim, [*jobs, Job([], 0, torch.float32, torch.device("cpu"))])
    seen: list[list[Any]] = []  # each job's step runs torch's foreach path (same bits)
    optim.register_step_pre_hook(lambda o, *_: seen.append([g["foreach"] for g in o.param_groups]))
    before = [p.detach().clone() for p in params]
    stepper(jobs[0])
    for i, (p, b) in enumerate(zip(params, before, strict=True)):
        assert torch.equal(p, b) == (i % 2 == 1), f"parameter {i} after the first job"
    stepper(jobs[1])
    plain.step()
    for p, q in zip(params, reference.parameters(), strict=True):
        assert torch.equal(p, q)
    assert [len(g["params"]) for g in optim.param_groups] == [3, len(params) - 3]
    assert seen == [[True, True]] * 2
    assert [g["foreach"] for g in optim.param_groups] == [None, None]  # unset again
    assert not foreach_on_cpu_groups(torch.optim.NAdam(params))  # its foreach rounds otherwise
    with pytest.raises(RuntimeError, match=r"1 local parameter\(s\).*in no sync job"):
        JobStepper(optim, [Job([], 0, torch.float32, torch.device("cpu"), owned=params[1:])])
    assert steps_per_tensor(torch.optim.AdamW) and not steps_per_tensor(torch.optim.LBFGS)
