"""gradsync_core's parameter-shard plan equals what torch's FSDP2 (``fully_shard``) does:
the same units (param groups, in FSDP2's order), and on every rank the same dim-0 chunk of
every parameter, padding included (docs/design.md §16)."""

import pytest
import torch
import torch.nn as nn

from gradsync_core import plan_param_shards
from gradsync_torch import param_specs
from tests.torch.harness import run_checks, run_workers


class Block(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.fc = nn.Linear(width, hidden)  # hidden = 1: a dim 0 smaller than the world
        self.out = nn.Linear(hidden, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out(torch.relu(self.fc(self.ln(x))))


class Net(nn.Module):
    """Uneven dim-0 sizes (11, 5, 4, 3, 1), a frozen parameter, and a parameter of the root
    module itself (FSDP2 lists it after its children's)."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))
        self.embed = nn.Embedding(11, 5)
        self.layers = nn.ModuleList([Block(5, 4), Block(5, 1)])  # 4 over 3 ranks: 2, 2, 0
        self.head = nn.Linear(5, 3)
        self.layers[1].ln.weight.requires_grad_(False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x) * self.scale


UNITS = ["layers.0.fc", "layers.0", "layers.1"]  # nested: layers.0.fc inside layers.0


def _check(rank: int, world_size: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Net()
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    plan = plan_param_shards(param_specs(model), world_size=world_size, units=UNITS)
    mesh = init_device_mesh("cpu", (world_size,))
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
        fsdp_params = {
            name_of[id(fp.sharded_param)]: fp
            for unit in plan.units
            if (group := modules[unit.prefix]._get_fsdp_state()._fsdp_param_group) is not None
            for fp in group.fsdp_params
        }
        for name, param in model.named_parameters():
            chunk = plan.chunk(name, rank)
            local = param.to_local()
            assert tuple(local.shape) == chunk.local_shape, (name, local.shape, chunk)
            assert tuple(param._local_tensor.shape) == chunk.local_shape, name
            padded = fsdp_params[name]._sharded_param_data  # FSDP2's padded local storage
            assert padded.numel() == chunk.padded_numel, (name, padded.numel(), chunk)
            assert torch.equal(local, full[name][chunk.start : chunk.stop]), name
            assert torch.count_nonzero(padded[chunk.numel :]) == 0, name  # padding is zeros
            assert param.requires_grad == plan.param(name).requires_grad, name

    return run_checks([("units", units_match), ("chunks", chunks_match)])


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_plan_equals_fully_shard(world_size):
    for results in run_workers(_check, world_size):
        failures = {name: error for name, error in results.items() if error is not None}
        assert not failures, "\n".join(f"{name}: {error}" for name, error in failures.items())
