"""Tensor/context-parallel linear layers (docs/design.md §5, §6).

Each parallel layer declares which of its parameters are sharded, and over which axes, in
``gradsync_sharded_over``; the model declares which axes split its tokens in
``gradsync_data_axes`` (``("cp",)``, plus ``"tp"`` under sequence parallelism). Every other
parameter — a plain ``nn.LayerNorm``, an embedding — is unsharded. ``shared_param_specs``
(``gradsync_torch._specs``) reads the declarations and applies ``gradsync_core.replicated_axes``
to every parameter, so a final norm under context parallelism gets its sum over ``cp`` without
anyone remembering to mark it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync_core import split_shapes
from gradsync_torch.groups import Group
from gradsync_torch.model_parallel.experts import ExpertMLPs
from gradsync_torch.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    reduce_from,
    reduce_scatter_to,
    scatter_to,
)


class _ShardedLinear(nn.Module):
    """Shared parts: a linear layer with one dimension of its weight split over ``group``.

    Args:
        in_features, out_features: the SERIAL layer's sizes (each rank holds its chunk).
        group: a ``ProcessGroups`` group, e.g. ``groups["tp"]``.
        bias: whether the layer has a bias.
        sequence_parallel: enter/leave the layer with sequence chunks instead of replicas.
        sequence_dim: the sequence dimension of the activations.
        device, dtype: as for ``nn.Linear``.
    """

    split_dim: int  # 0: output features (column parallel), 1: input features (row parallel)
    sharded_params: tuple[str, ...]  # the parameters split over the group

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        bias: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(group, Group):
            raise TypeError(
                f"group must be a gradsync_torch Group (ProcessGroups(...)['tp']), got "
                f"{type(group).__name__}: the layer needs the group's axis names"
            )
        self.in_features, self.out_features, self.group = in_features, out_features, group
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        full = (out_features, in_features)
        self.sizes = split_shapes(full[self.split_dim], group.size)
        shape = list(full)
        shape[self.split_dim] = self.sizes[group.group_rank]
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(shape, **kw))
        bias_numel = self.sizes[group.group_rank] if self.split_dim == 0 else out_features
        self.bias = nn.Parameter(torch.empty(bias_numel, **kw)) if bias else None
        self.gradsync_sharded_over = {name: group.axes for name in self.sharded_params}
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # nn.Linear's distribution, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), with the FULL fan_in.
        bound = 1 / math.sqrt(self.in_features)
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of the serial layer's tensor ``name`` (a weight or a gradient)."""
        dim = self.split_dim if name == "weight" else (0 if self.split_dim == 0 else None)
        if dim is None:
            return full
        return full.split(list(self.sizes), dim=dim)[self.group.group_rank]

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"group={self.group.name!r} {self.sizes}, sequence_parallel={self.sequence_parallel}"
        )


class ColumnParallelLinear(_ShardedLinear):
    """``y = x A^T + b`` with ``A``'s rows (output features) and ``b`` split over ``group``.

    Input: replicated over the group (entered with ``copy_to``), or, with
    ``sequence_parallel``, this rank's chunk of the sequence (``all_gather_from`` along
    ``sequence_dim``). Output: this rank's ``split_shapes(out_features, n)`` chunk of features.

    Example:
        >>> fc1 = ColumnParallelLinear(8, 32, groups["tp"])  # weight (32 / tp, 8)
    """

    split_dim = 0
    sharded_params = ("weight", "bias")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = all_gather_from(x, self.group, dim=self.sequence_dim)
        else:
            x = copy_to(x, self.group)
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(_ShardedLinear):
    """``y = x A^T + b`` with ``A``'s columns (input features) split over ``group``.

    Input: this rank's feature chunk (from a column-parallel layer); ``input_is_parallel=False``
    scatters a replicated input first. The partial products are summed with ``reduce_from``,
    or with ``reduce_scatter_to`` along ``sequence_dim`` under sequence parallelism. The bias
    is added after the sum, so it is unsharded; under sequence parallelism it then meets a
    sequence chunk and its gradient is partial (``shared_param_specs`` derives the sum).
    """

    split_dim = 1
    sharded_params = ("weight",)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        group: Group,
        *,
        input_is_parallel: bool = True,
        **keywords: Any,
    ) -> None:
        super().__init__(in_features, out_features, group, **keywords)
        self.input_is_parallel = input_is_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to(x, self.group, dim=-1)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to(y, self.group, dim=self.sequence_dim)
        else:
            y = reduce_from(y, self.group)
        return y if self.bias is None else y + self.bias


def local_state(model: nn.Module, full: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's shard of every tensor in ``full`` (serial names: a state dict or grads).

    Parallel layers and expert blocks cut their own tensors (``local_shard``); all others
    are kept whole.
    """
    owners = {}
    for prefix, module in model.named_modules():
        if isinstance(module, _ShardedLinear | ExpertMLPs):
            for name, _ in module.named_parameters(recurse=False):
                owners[f"{prefix}.{name}" if prefix else name] = (module, name)
    out = {}
    for key, value in full.items():
        if key in owners:
            module, name = owners[key]
            out[key] = module.local_shard(name, value)
        else:
            out[key] = value
    return out
