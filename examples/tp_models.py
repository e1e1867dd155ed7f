"""Reference MLP models for the tensor/context-parallel example and tests (not gradsync API).

``MLPTransformer`` is the serial model; ``ParallelMLPTransformer`` holds this rank's shards
of it over ``tp`` (and splits tokens over ``cp``), built from gradsync_torch's public
column/row-parallel layers, so a script can compare outputs and gradients with the serial one.
``examples/torch_tp_train.py`` trains them; ``tests/torch/models.py`` re-exports them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from gradsync_torch import (
    ColumnParallelLinear,
    Group,
    ProcessGroups,
    RowParallelLinear,
    local_state,
)


class MLPBlock(nn.Module):
    """Serial reference block: ``x + fc2(gelu(fc1(ln(x))))`` (a transformer block, no attention)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class MLPTransformer(nn.Module):
    """Serial reference: ``depth`` ``MLPBlock``s and a final ``LayerNorm``, on (batch, seq, dim)."""

    def __init__(self, dim: int, hidden: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MLPBlock(dim, hidden) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class ParallelMLPBlock(nn.Module):
    """``MLPBlock`` with fc1 column-parallel and fc2 row-parallel over ``tp``.

    The LayerNorm is torch's own: under context or sequence parallelism it normalizes a
    sequence chunk, token by token, exactly as the serial one does; its gradient is partial
    and ``shared_param_specs`` derives the sum.
    """

    def __init__(
        self, dim: int, hidden: int, tp: Group, *, sequence_parallel: bool = False
    ) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.fc1 = ColumnParallelLinear(dim, hidden, tp, sequence_parallel=sequence_parallel)
        self.fc2 = RowParallelLinear(hidden, dim, tp, sequence_parallel=sequence_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class ParallelMLPTransformer(nn.Module):
    """``MLPTransformer`` over ``groups``: tensor-parallel blocks, tokens split over ``cp``.

    Input on each rank: (batch, its ``cp`` chunk of the sequence, dim), and with
    ``sequence_parallel`` only its ``tp`` chunk of that chunk. Output: the same tokens.

    Example:
        >>> model = ParallelMLPTransformer.from_serial(serial, groups)
        >>> plan = plan_shared_reductions(shared_param_specs(model), groups.topology)
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        depth: int,
        groups: ProcessGroups,
        *,
        sequence_parallel: bool = False,
    ) -> None:
        super().__init__()
        tp = groups.group("tp")
        self.blocks = nn.ModuleList(
            ParallelMLPBlock(dim, hidden, tp, sequence_parallel=sequence_parallel)
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(dim)
        self.sequence_parallel = sequence_parallel
        # The axes that split this model's tokens: what replicated_over is derived from.
        self.gradsync_data_axes = ("cp", "tp") if sequence_parallel else ("cp",)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)

    @classmethod
    def from_serial(
        cls, serial: MLPTransformer, groups: ProcessGroups, *, sequence_parallel: bool = False
    ) -> ParallelMLPTransformer:
        """The parallel model holding this rank's shards of ``serial``'s parameters."""
        first = serial.blocks[0]
        model = cls(
            first.fc1.in_features,
            first.fc1.out_features,
            len(serial.blocks),
            groups,
            sequence_parallel=sequence_parallel,
        ).to(dtype=first.fc1.weight.dtype, device=first.fc1.weight.device)
        model.load_state_dict(local_state(model, serial.state_dict()))
        return model
