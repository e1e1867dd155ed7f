"""A mixture-of-experts block under DataParallel matches the serial model (docs/design.md §5, §6).

4 gloo ranks, one spawn, ``Topology.create(4, ep=2)``: dense dp = 4, ep = 2, edp = 2. The
model is a dense input projection, then ``MoE`` (a router and 4 experts, 2 per rank). Each
rank feeds its quarter of the batch; its loss is the mean over its own tokens, so the dense
mean over dp is the full-batch mean. The output, EVERY gradient and one Adam step (parameters
and both moments) must equal the serial model's (all experts on one process, full batch) in
float64; the step runs in two ZeRO-1 optimizers, dense owners over dp and expert owners over
edp. Rank-0-of-edp weights must reach the other edp ranks (ranks with other experts are
left alone), and a control with the expert gradients left local shows the checks can fail.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from gradsync_core import Topology
from gradsync_torch import DataParallel, ProcessGroups, ZeroRedundancyOptimizer
from gradsync_torch._specs import shared_param_specs
from gradsync_torch.groups import Group
from gradsync_torch.model_parallel.experts import MoE
from gradsync_torch.model_parallel.layers import local_state
from tests.support.harness import run_workers

TOL = {"rtol": 1e-10, "atol": 1e-12}
DIM, HIDDEN, EXPERTS, ROWS_PER_RANK, SEQ = 6, 10, 4, 2, 3


class MoEModel(nn.Module):
    """A dense projection, then a residual MoE block."""

    gradsync_data_axes: tuple[str, ...] = ()  # no model-parallel axis splits the tokens

    def __init__(self, group: Group | None) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.moe = MoE(DIM, HIDDEN, EXPERTS, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h + self.moe(h)


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((out - target) ** 2).sum() / out[..., 0].numel()  # mean over the tokens given


def _serial(world_size: int) -> tuple[MoEModel, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    serial = MoEModel(None).double()
    gen = torch.Generator().manual_seed(1)
    shape = (world_size * ROWS_PER_RANK, SEQ, DIM)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    target = torch.randn(*shape, generator=gen, dtype=torch.float64)
    out = serial(x)
    _loss(out, target).backward()
    return serial, x, target, out.detach()


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    groups = ProcessGroups(Topology.create(world_size, ep=2))
    serial, x, target, serial_out = _serial(world_size)
    ref_grads = {n: p.grad for n, p in serial.named_parameters()}
    rows = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)

    expected = local_state(MoEModel(groups["ep"]), ref_grads)
    # Control: the gradients of this rank alone (no reduction at all) are wrong.
    control = MoEModel(groups["ep"]).double()
    control.load_state_dict(local_state(control, serial.state_dict()))
    _loss(control(x[rows]), target[rows]).backward()
    local_wrong = sorted(
        n for n, p in control.named_parameters() if not torch.allclose(p.grad, expected[n], **TOL)
    )

    model = MoEModel(groups["ep"]).double()
    model.load_state_dict(local_state(model, serial.state_dict()))
    expected_weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    if groups.group_rank("edp") != 0:  # DataParallel must copy edp rank 0's weights here
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    wrapped = DataParallel(model, groups=groups)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p, expected_weights[name], rtol=0, atol=0, msg=name)

    out = wrapped(x[rows])
    torch.testing.assert_close(out, serial_out[rows], **TOL)
    _loss(out, target[rows]).backward()
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")

    # ZeRO-1 owners: dense parameters over dp, experts over edp (one optimizer each); one
    # optimizer holding both is refused. A plain Adam on a copy checks the moments.
    with pytest.raises(ValueError, match=r"expert parameters \(.*\) and dense ones"):
        ZeroRedundancyOptimizer(model.named_parameters(), torch.optim.Adam, lr=1e-2)
    named = list(model.named_parameters())
    zero_dense = ZeroRedundancyOptimizer(
        [(n, p) for n, p in named if "experts" not in n],
        torch.optim.Adam,
        process_group=groups["dp"].process_group,
        lr=1e-2,
    )
    zero_experts = ZeroRedundancyOptimizer(
        [(n, p) for n, p in named if "experts" in n],
        torch.optim.Adam,
        process_group=groups["edp"].process_group,
        lr=1e-2,
    )
    plain = {n: p.detach().clone().requires_grad_() for n, p in named}
    for n, p in named:
        plain[n].grad = p.grad.clone()
    zero_dense.step()
    zero_experts.step()

    # One Adam step from the same gradients: parameters and both moments.
    serial_opt = torch.optim.Adam(serial.parameters(), lr=1e-2)
    opt = torch.optim.Adam(plain.values(), lr=1e-2)
    serial_opt.step()
    opt.step()
    serial_state = {n: serial_opt.state[p] for n, p in serial.named_parameters()}
    for key in ("exp_avg", "exp_avg_sq"):
        full = {n: s[key] for n, s in serial_state.items()}
        want = local_state(model, full)
        for name, p in plain.items():
            torch.testing.assert_close(opt.state[p][key], want[name], **TOL)
    want = local_state(model, dict(serial.named_parameters()))
    for name, p in model.named_parameters():  # after the ZeRO steps and their broadcasts
        torch.testing.assert_close(p, want[name], **TOL, msg=lambda m, n=name: f"{n}: {m}")
        torch.testing.assert_close(plain[name], want[name], **TOL)

    # The two DeviceMesh views: the dense mesh (dp = 4) and the expert one (edp x ep).
    dense_mesh, expert_mesh = groups.device_mesh(), groups.device_mesh(expert=True)
    assert dense_mesh.mesh_dim_names == ("dp",)
    assert expert_mesh.mesh_dim_names == ("edp", "ep")
    assert expert_mesh.mesh.tolist() == [[0, 1], [2, 3]]
    for axis in ("edp", "ep"):
        assert dist.get_process_group_ranks(expert_mesh.get_group(axis)) == list(groups.ranks(axis))
    groups_plan = wrapped.shared_plan
    return {
        "local_wrong": local_wrong,
        "edp_names": groups_plan.reduction("edp").names,
        "experts": [s.name for s in shared_param_specs(model) if s.expert],
        "world": dist.get_world_size(),
    }


def test_moe_data_parallel_matches_serial() -> None:
    results = run_workers(_worker, 4)
    for result in results:
        assert result["experts"] == ["moe.experts.w_in", "moe.experts.w_out"]
        assert set(result["edp_names"]) == {"moe.experts.w_in", "moe.experts.w_out"}
        # Without the reductions every weight's gradient is wrong, experts included.
        assert result["local_wrong"] == [
            "moe.experts.w_in",
            "moe.experts.w_out",
            "moe.router.weight",
            "proj.bias",
            "proj.weight",
        ]


def test_expert_model_without_groups_is_refused() -> None:
    model = MoEModel(None)
    with pytest.raises(ValueError, match=r"expert parameters \('moe\.experts\.w_in'.*groups="):
        DataParallel(model)
