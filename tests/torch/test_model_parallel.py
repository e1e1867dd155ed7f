"""Tensor/context parallelism on 4 gloo ranks: groups, the six mappings, the reference model.

One spawn per configuration (tp=2 x dp=2, cp=2 x tp=2) runs every check. The mappings are
checked forward and backward against their definitions with integer-valued float64 data
(sums are exact in any order, so equality is bitwise); the model against the serial model
with the full batch on every rank (float64, rtol 1e-10: only summation order differs).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from gradsync_core import STANDARD_GROUPS, Topology, plan_shared_reductions, split_shapes
from gradsync_torch._specs import shared_param_specs
from gradsync_torch.groups import Group, ProcessGroups
from gradsync_torch.model_parallel.layers import local_state
from gradsync_torch.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    gather_from,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)
from gradsync_torch.shared_reductions import check_reduction_plan, reduce_shared_gradients
from tests.support.batches import local_tokens
from tests.support.harness import run_workers
from tests.torch.models import MLPTransformer, ParallelMLPTransformer

TOL = {"rtol": 1e-10, "atol": 1e-12}


def _ints(seed: int, *shape: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(-8, 9, shape, generator=gen).to(torch.float64)


def _check(fn, x: torch.Tensor, out: torch.Tensor, cotangent: torch.Tensor, grad: torch.Tensor):
    x = x.clone().requires_grad_(True)
    y = fn(x)
    assert torch.equal(y, out), (fn, y, out)
    (gx,) = torch.autograd.grad(y, x, cotangent)
    assert torch.equal(gx, grad), (fn, gx, grad)


def _check_mappings(group: Group) -> int:
    """Every mapping, forward and backward, against its definition; returns checks run."""
    n, r, checks = group.size, group.group_rank, 0
    for full in sorted({2 * n, 2 * n + 1, n + 1, 3 * n - 1}):  # even and uneven splits
        sizes = split_shapes(full, n)
        X = [_ints(100 * full + q, 2, full, 3) for q in range(n)]  # rank q's full tensor
        G = [_ints(200 * full + q, 2, full, 3) for q in range(n)]  # rank q's full cotangent
        g = [_ints(300 * full + q, 2, sizes[q], 3) for q in range(n)]  # rank q's chunk cot.

        def cut(t: torch.Tensor, sizes: tuple[int, ...] = sizes) -> tuple[torch.Tensor, ...]:
            return t.split(list(sizes), dim=1)

        total_x, total_g = sum(X), sum(G)
        _check(lambda x: copy_to(x, group), X[0], X[0], G[r], total_g)
        _check(lambda x: reduce_from(x, group), X[r], total_x, G[r], G[r])
        _check(lambda x: scatter_to(x, group, dim=1), X[0], cut(X[0])[r], g[r], torch.cat(g, 1))
        for size in (full, None):  # chunk sizes given, or exchanged
            _check(
                lambda x, s=size: gather_from(x, group, dim=1, size=s),
                cut(X[0])[r],
                X[0],
                G[r],
                cut(G[r])[r],
            )
            _check(
                lambda x, s=size: all_gather_from(x, group, dim=1, size=s),
                cut(X[r])[r],
                torch.cat([cut(X[q])[q] for q in range(n)], 1),
                G[r],
                cut(total_g)[r],
            )
        _check(
            lambda x: reduce_scatter_to(x, group, dim=1),
            X[r],
            cut(total_x)[r],
            g[r],
            torch.cat(g, 1),
        )
        checks += 8
    # The last dim (a negative dim) and a size that does not match the chunks.
    x = _ints(7, 3, 2 * n)
    _check(lambda t: scatter_to(t, group), x, x.split(2, -1)[r], x.split(2, -1)[r], x)
    if n == 2:
        with pytest.raises(ValueError, match=r"split_shapes\(5, 2\).*pass the full size"):
            gather_from(torch.zeros(2, 3 if r == 1 else 2), group, size=5)
    return checks + 1


def _check_groups(groups: ProcessGroups, new_group_calls: int, expected_calls: int) -> None:
    topo, rank = groups.topology, dist.get_rank()
    assert new_group_calls == expected_calls
    for name in STANDARD_GROUPS:
        group = groups.group(name)
        assert group.ranks == topo.group_of(name, rank)
        assert group.group_rank == topo.group_rank(name, rank) == groups.group_rank(name)
        if group.size == 1:
            assert group.pg is None
            with pytest.raises(ValueError, match=r"one rank .* no process group"):
                group.process_group  # noqa: B018  (the property raises)
            continue
        assert dist.get_process_group_ranks(group.process_group) == list(group.ranks)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=group.process_group)
        assert t.item() == sum(group.ranks)
    assert groups.group("cp-tp") is groups.group("tp-cp")
    with pytest.raises(KeyError, match="was not created"):
        groups.group("tp-ep-dp")
    mesh = groups.device_mesh()
    live = tuple(a for a in topo.mesh_axis_names if getattr(topo, a) > 1)
    assert mesh.mesh_dim_names == live
    assert mesh.mesh.flatten().tolist() == list(range(topo.world_size))
    for axis in live:
        assert dist.get_process_group_ranks(mesh.get_group(axis)) == list(groups.ranks(axis))


def _check_model(groups: ProcessGroups, sp: bool, norm_group: str | None) -> dict[str, Any]:
    topo, rank = groups.topology, dist.get_rank()
    dim, hidden, depth, batch, seq = 8, 9, 2, 2 * topo.dp, 7  # 9 -> [5, 4]; 7 -> [4, 3]
    torch.manual_seed(0)
    serial = MLPTransformer(dim, hidden, depth).double()
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    target = torch.randn(batch, seq, dim, generator=gen, dtype=torch.float64)
    y_ref = serial(x)
    (((y_ref - target) ** 2).sum() / (batch * seq)).backward()

    model = ParallelMLPTransformer.from_serial(serial, groups, sequence_parallel=sp)
    y = model(local_tokens(topo, rank, x, sp))
    torch.testing.assert_close(y, local_tokens(topo, rank, y_ref.detach(), sp), **TOL)
    # This rank's share of its replica's loss: divide by the replica's token count.
    t = local_tokens(topo, rank, target, sp)
    (((y - t) ** 2).sum() / (batch // topo.dp * seq)).backward()
    dp = groups.group("dp")
    for p in model.parameters():  # the data-parallel mean, as DataParallel does it
        if dp.size > 1:
            dist.all_reduce(p.grad, group=dp.process_group)
        p.grad /= dp.size
    raw = {name: p.grad.clone() for name, p in model.named_parameters()}

    plan = plan_shared_reductions(shared_param_specs(model), topo, cap_bytes=256)
    check_reduction_plan(plan, groups)
    assert plan.group_of("norm.weight") == norm_group
    reduce_shared_gradients(model, groups, plan)
    expected = local_state(model, {n: p.grad for n, p in serial.named_parameters()})
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
    # Without the derived sums exactly the planned parameters would be wrong.
    wrong = {n for n, g in raw.items() if not torch.allclose(g, expected[n], **TOL)}
    planned = {name for r in plan.reductions for name in r.names}
    assert wrong == planned, (wrong, planned)
    return {"groups": plan.group_names, "wrong_without": sorted(wrong)}


def _check_plan_mismatch(groups: ProcessGroups) -> None:
    """Members of a group holding different plans get an error naming both, not a hang."""
    group = next(g for g in groups if g.size > 1 and g.name in ("cp", "tp"))
    model = ParallelMLPTransformer(8 if groups.rank == group.ranks[0] else 6, 8, 1, groups)
    axes = ("cp", "tp")  # every parameter replicated somewhere: tp and cp groups planned
    plan = plan_shared_reductions(shared_param_specs(model, data_axes=axes), groups.topology)
    with pytest.raises(ValueError, match=r"ranks \d and \d of group .* hold different"):
        check_reduction_plan(plan, groups)
    # A rank whose model has no replicated parameters plans no sums at all.
    data = () if groups.rank == 1 else axes
    plan = plan_shared_reductions(shared_param_specs(model, data_axes=data), groups.topology)
    with pytest.raises(ValueError, match=r"plans extra sums over .* but rank \d over"):
        check_reduction_plan(plan, groups)
    with pytest.raises(ValueError, match=r"needs 8 ranks .* has 4"):
        ProcessGroups(Topology.create(8, tp=2))


def _run_config(world_size: int, sizes: dict[str, int], expected_calls: int) -> dict:
    real_new_group, calls = dist.new_group, []
    dist.new_group = lambda *a, **k: calls.append(a) or real_new_group(*a, **k)
    try:
        groups = ProcessGroups(Topology.create(world_size, **sizes))
    finally:
        dist.new_group = real_new_group
    _check_groups(groups, len(calls), expected_calls)
    mapping_checks = sum(_check_mappings(groups.group(name)) for name in ("tp", "tp-dp-cp"))
    singleton = next(g for g in groups if g.size == 1)
    x = torch.ones(2, 3)
    assert all(
        f(x, singleton) is x for f in (copy_to, reduce_from, scatter_to, gather_from)
    ) and all(f(x, singleton) is x for f in (reduce_scatter_to, all_gather_from))
    norm = {"dp": (None, "tp"), "cp": ("cp", "tp-cp")}["cp" if sizes.get("cp") else "dp"]
    results = {sp: _check_model(groups, sp, norm[sp]) for sp in (False, True)}
    _check_plan_mismatch(groups)
    return {"mapping_checks": mapping_checks, "models": results}


CONFIGS = {"tp2-dp2": ({"tp": 2}, 4), "cp2-tp2": ({"tp": 2, "cp": 2}, 4)}


def _worker(rank: int, world_size: int) -> dict:
    # Both configurations share one spawn: starting 4 processes costs more than all checks.
    torch.set_default_dtype(torch.float64)
    return {key: _run_config(world_size, *config) for key, config in CONFIGS.items()}


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_workers(_worker, 4)


def _mapping_checks_ran(results: list[dict], key: str) -> None:
    counts = [r[key]["mapping_checks"] for r in results]
    assert counts[0] > 0 and counts == [counts[0]] * 4


def test_tp2_dp2_plain_tp_needs_no_sum_sequence_parallel_sums_over_tp(results):
    _mapping_checks_ran(results, "tp2-dp2")
    models = results[0]["tp2-dp2"]["models"]
    assert models[False] == {"groups": (), "wrong_without": []}  # copy-to already summed
    assert models[True]["groups"] == ("tp",)
    assert "blocks.0.fc2.bias" in models[True]["wrong_without"]


def test_cp2_tp2_mappings(results):
    # The final norm's cp sum is asserted in test_shared_reductions_dp.py (through DataParallel).
    _mapping_checks_ran(results, "cp2-tp2")
