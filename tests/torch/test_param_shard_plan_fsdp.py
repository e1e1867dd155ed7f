"""gradsync_core's parameter-shard plan equals what torch's FSDP2 (``fully_shard``) does:
the same units (param groups, in FSDP2's order), and on every rank the same dim-0 chunk of
every parameter, padding included; the ZeRO-3 memory estimate's parameter, gradient and AdamW
state bytes equal FSDP2's after a step (docs/design.md §16)."""

import pytest
import torch
import torch.nn as nn

from gradsync_core import estimate_zero3, plan_param_shards
from gradsync_torch import param_specs
from tests.support.harness import run_checks, run_workers
from tests.torch.fsdp_models import UNITS, Net


def fsdp_params(model: nn.Module, plan) -> dict:
    """FSDP2's ``FSDPParam`` of every parameter, by name, from each unit's param group."""
    modules = dict(model.named_modules())
    name_of = {id(p): name for name, p in model.named_parameters()}
    return {
        name_of[id(fp.sharded_param)]: fp
        for unit in plan.units
        if (group := modules[unit.prefix]._get_fsdp_state()._fsdp_param_group) is not None
        for fp in group.fsdp_params
    }


def _check(rank: int, world_size: int, replicate: int = 1) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    specs = param_specs(model)
    dp_shard = world_size // replicate
    plan = plan_param_shards(specs, world_size=world_size, units=UNITS, dp_shard=dp_shard)
    # HSDP: FSDP2's 2-D mesh ("replicate", "shard"), so a shard group is consecutive ranks.
    if replicate == 1:
        mesh = init_device_mesh("cpu", (world_size,))
    else:
        mesh = init_device_mesh("cpu", (replicate, plan.shard_size), mesh_dim_names=("r", "s"))
    shard_rank = rank % plan.shard_size
    modules = dict(model.named_modules())
    for prefix in UNITS:  # bottom-up, as FSDP2 requires: the inner block first
        fully_shard(modules[prefix], mesh=mesh)
    fully_shard(model, mesh=mesh)
    name_of = {id(p): name for name, p in model.named_parameters()}

    def units_match() -> None:
        for unit in plan.units:
            group = modules[unit.prefix]._get_fsdp_state()._fsdp_param_group
            got = (
                ()
                if group is None
                else tuple(name_of[id(fp.sharded_param)] for fp in group.fsdp_params)
            )
            assert got == unit.params, (unit.prefix, got, unit.params)

    def chunks_match() -> None:
        by_name = fsdp_params(model, plan)
        for name, param in model.named_parameters():
            chunk = plan.chunk(name, shard_rank)
            local = param.to_local()
            assert tuple(local.shape) == chunk.local_shape, (name, local.shape, chunk)
            assert tuple(param._local_tensor.shape) == chunk.local_shape, name
            padded = by_name[name]._sharded_param_data  # FSDP2's padded local storage
            assert padded.numel() == chunk.padded_numel, (name, padded.numel(), chunk)
            assert torch.equal(local, full[name][chunk.start : chunk.stop]), name
            assert torch.count_nonzero(padded[chunk.numel :]) == 0, name  # padding is zeros
            assert param.requires_grad == plan.param(name).requires_grad, name

    def memory_matches() -> None:
        # The estimate's resident terms are FSDP2's bytes exactly: padded parameter storage,
        # gradients as views into the padded reduce-scatter output, unpadded AdamW moments.
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.arange(6).reshape(2, 3) % 11).square().mean().backward()
        opt.step()
        predicted = estimate_zero3(plan, optimizer="adamw").ranks[shard_rank]
        padded = sum(fp._sharded_param_data.nbytes for fp in fsdp_params(model, plan).values())
        grads = {
            p.grad.to_local().untyped_storage().data_ptr(): p.grad.to_local().untyped_storage()
            for p in model.parameters()
            if p.grad is not None
        }
        state = sum(
            value.to_local().nbytes
            for per_param in opt.state.values()
            for key, value in per_param.items()
            if key != "step"
        )
        measured = (padded, sum(s.nbytes() for s in grads.values()), state)
        assert measured == (
            predicted.parameter_bytes,
            predicted.gradient_bytes,
            predicted.optimizer_state_bytes,
        ), (measured, predicted)

    checks = [("units", units_match), ("chunks", chunks_match), ("memory", memory_matches)]
    return run_checks(checks)


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_plan_equals_fully_shard(world_size):
    for results in run_workers(_check, world_size):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())


@pytest.mark.slow
def test_hsdp_plan_equals_fully_shard_on_a_2d_mesh():
    # 4 ranks as 2 replicas x 2 shards: each rank holds its shard rank's chunk.
    for results in run_workers(_check, 4, 2):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())
