"""DataParallel(groups=...) adds the derived model-parallel sums to the dp mean (docs/design.md §6).

4 gloo ranks, one spawn, two topologies: tp=2 x dp=2 with sequence parallelism (the fc2
biases and the norms are summed over ``tp``) and cp=2 x tp=2 (dp=1; the norms and fc2 biases
over ``cp``, plus ``tp-cp`` with sequence parallelism). Every gradient, with NO manual call,
must equal the serial model's full-batch gradient on the same weights: float64, rtol 1e-10,
atol 1e-12 (only the summation order differs). A control built with an empty plan gets
exactly the planned parameters wrong, so the checks can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import ReductionPlan, Topology
from gradsync_torch import DataParallel, ProcessGroups
from gradsync_torch.model_parallel.layers import local_state
from tests.support.batches import local_tokens
from tests.support.harness import run_workers
from tests.torch.models import MLPTransformer, ParallelMLPTransformer

TOL = {"rtol": 1e-10, "atol": 1e-12}
DIM, HIDDEN, DEPTH, SEQ = 8, 9, 2, 7  # 9 -> [5, 4] over tp; 7 -> [4, 3] over cp


class Case:
    """One topology: the serial model, its full-batch gradients and this rank's tokens."""

    def __init__(self, groups: ProcessGroups, sp: bool) -> None:
        self.groups, self.sp, self.topo = groups, sp, groups.topology
        self.batch = 4 * self.topo.dp  # 4 rows per replica: split in 2 micro-batches below
        torch.manual_seed(0)
        self.serial = MLPTransformer(DIM, HIDDEN, DEPTH).double()
        gen = torch.Generator().manual_seed(1)
        shape = (self.batch, SEQ, DIM)
        self.x = torch.randn(*shape, generator=gen, dtype=torch.float64)
        self.target = torch.randn(*shape, generator=gen, dtype=torch.float64)
        (((self.serial(self.x) - self.target) ** 2).sum() / (self.batch * SEQ)).backward()
        self.ref = {n: p.grad for n, p in self.serial.named_parameters()}

    def model(self) -> ParallelMLPTransformer:
        return ParallelMLPTransformer.from_serial(
            self.serial, self.groups, sequence_parallel=self.sp
        )

    def backward(self, wrapped: nn.Module, rows: slice = slice(None)) -> None:
        """This rank's share of its replica's loss (divided by the REPLICA's token count)."""
        rank = dist.get_rank()
        x = local_tokens(self.topo, rank, self.x, self.sp)[rows]
        t = local_tokens(self.topo, rank, self.target, self.sp)[rows]
        (((wrapped(x) - t) ** 2).sum() / (self.batch // self.topo.dp * SEQ)).backward()

    def wrong(self, model: nn.Module) -> set[str]:
        """Parameters whose gradient differs from the serial one (all must have one)."""
        expected = local_state(model, self.ref)
        out = set()
        for name, p in model.named_parameters():
            assert p.grad is not None, name
            if not torch.allclose(p.grad, expected[name], **TOL):
                out.add(name)
        return out

    def assert_right(self, model: nn.Module, what: str) -> None:
        expected = local_state(model, self.ref)
        for name, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad, expected[name], **TOL, msg=lambda m, n=name: f"{what}, {n}: {m}"
            )


def _check_modes(case: Case) -> dict[str, Any]:
    """Overlap, legacy, bucket views, no_sync, and the control without sums."""
    groups = case.groups
    modes = {
        "overlap": {},
        "overlap_small_buckets": {"bucket_cap_mb": 256 / 2**20},
        "bucket_view": {"gradient_as_bucket_view": True},
        "legacy": {"overlap": False},
    }
    planned: tuple[str, ...] = ()
    for mode, kwargs in modes.items():
        model = case.model()
        wrapped = DataParallel(model, groups=groups, **kwargs)
        planned = tuple(n for r in wrapped.shared_plan.reductions for n in r.names)
        for step in range(2):  # the second backward runs on the rebuilt layout
            model.zero_grad(set_to_none=True)
            case.backward(wrapped)
            wrapped.sync_gradients()  # legacy: the sync; overlap: a no-op
            case.assert_right(model, f"{mode} step {step}")
    # Gradient accumulation: two micro-batches under no_sync, the sums run once at the end.
    for kwargs in ({}, {"overlap": False}, {"gradient_as_bucket_view": True}):
        model = case.model()
        wrapped = DataParallel(model, groups=groups, **kwargs)
        with wrapped.no_sync():
            case.backward(wrapped, slice(0, 1))
            wrapped.sync_gradients()  # inside no_sync: nothing (as fairseq's)
        partial = case.wrong(model)
        case.backward(wrapped, slice(1, None))
        wrapped.sync_gradients()
        case.assert_right(model, f"no_sync {kwargs}")
        assert partial == {n for n, _ in model.named_parameters()}, partial
    # Control: the same wrapper with an empty plan (no sums) -> exactly the planned ones wrong.
    model = case.model()
    empty = ReductionPlan(topology=case.topo, reductions=())
    wrapped = DataParallel(model, groups=groups, shared_plan=empty)
    case.backward(wrapped)
    wrong_without = case.wrong(model)
    assert wrong_without == set(planned), (wrong_without, planned)
    plan = DataParallel(case.model(), groups=groups).shared_plan
    return {
        "groups": plan.group_names,
        "norm": plan.group_of("norm.weight"),
        "wrong_without": sorted(wrong_without),
    }


def _check_errors(case: Case) -> None:
    groups = case.groups
    with pytest.raises(ValueError, match=r"process_group or groups, not both"):
        DataParallel(case.model(), groups=groups, process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"shared_plan needs groups="):
        DataParallel(case.model(), shared_plan=ReductionPlan(topology=case.topo, reductions=()))
    with pytest.raises(ValueError, match=r"derives the model-parallel .* gradsync_data_axes"):
        DataParallel(nn.Linear(4, 4).double(), groups=groups)
    with pytest.raises(ValueError, match=r"shard_gradients=True cannot be combined"):
        DataParallel(case.model(), groups=groups, shard_gradients=True)


def _worker(rank: int, world_size: int) -> dict:
    torch.set_default_dtype(torch.float64)
    out = {}
    for key, sizes in {"tp2-dp2": {"tp": 2}, "cp2-tp2": {"tp": 2, "cp": 2}}.items():
        groups = ProcessGroups(Topology.create(world_size, **sizes))
        for sp in (False, True) if key == "cp2-tp2" else (True,):
            case = Case(groups, sp)
            out[f"{key}{'-sp' if sp else ''}"] = _check_modes(case)
        _check_errors(case)
    # ZeRO-2 stays available where no sums are needed (plain tp over dp=2: none planned).
    groups = ProcessGroups(Topology.create(world_size, tp=2))
    plain = Case(groups, sp=False)
    wrapped = DataParallel(plain.model(), groups=groups, shard_gradients=True)
    out["zero2_plain_tp_groups"] = wrapped.shared_plan.group_names
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 4)


def test_tp2_dp2_sequence_parallel_sums_over_tp(results):
    r = results[0]["tp2-dp2-sp"]
    assert r["groups"] == ("tp",) and r["norm"] == "tp"
    assert "blocks.0.fc2.bias" in r["wrong_without"] and "norm.weight" in r["wrong_without"]


def test_cp2_tp2_final_norm_gets_its_cp_sum(results):
    r = results[0]["cp2-tp2"]
    assert r["groups"] == ("cp",) and r["norm"] == "cp"
    assert "norm.weight" in r["wrong_without"]  # the tutorial's forgotten norm
    r = results[0]["cp2-tp2-sp"]
    assert r["groups"] == ("cp", "tp-cp") and r["norm"] == "tp-cp"
    assert "norm.weight" in r["wrong_without"]


def test_every_rank_agrees_and_zero2_without_sums(results):
    assert all(r == results[0] for r in results)
    assert results[0]["zero2_plain_tp_groups"] == ()
