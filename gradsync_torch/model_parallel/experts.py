"""A mixture-of-experts block whose experts are split over the ``ep`` group (docs/design.md §5, §6).

``ExpertMLPs`` declares its weights split over ``"ep"`` (each parameter's
``gradsync_sharded_over``, what JAX derives from a ``PartitionSpec``): ``shared_param_specs``
turns the declaration into ``ParamSpec.expert``, so DataParallel averages these gradients over
the expert data-parallel group ``edp`` instead of the dense ``dp``, and ZeroRedundancyOptimizer
refuses to plan them with dense ones, without anyone marking a weight by hand.

Token dispatch follows Megatron-core's all-gather dispatcher: every rank of the ``ep`` group
gathers the group's tokens and router probabilities, applies the experts it holds to the
tokens routed to them, and a reduce-scatter returns each token's output to its owner (each
token is processed on exactly one rank, the others contribute zeros). The backward of the
gather is a reduce-scatter and that of the reduce-scatter a gather, so an expert's gradient
holds the contributions of every token routed to it from the whole ``ep`` group.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gradsync_torch.groups import Group
from gradsync_torch.model_parallel.mappings import all_gather_from, reduce_scatter_to


class ExpertMLPs(nn.Module):
    """``num_experts`` two-layer GELU MLPs; this rank holds those of its ``ep`` coordinate.

    Rank ``g`` of the ``ep`` group holds experts ``g * local .. (g + 1) * local - 1`` with
    ``local = num_experts // ep``, stacked in ``w_in`` (``local x dim x hidden``) and
    ``w_out`` (``local x hidden x dim``).

    Args:
        dim, hidden: model and expert hidden widths.
        num_experts: experts of the SERIAL layer.
        group: the ``ep`` group (``ProcessGroups(...)["ep"]``); ``None``: all experts here.
        device, dtype: as for ``nn.Linear``.

    Raises:
        ValueError: if ``num_experts`` is not a multiple of the group size.
    """

    expert_params = ("w_in", "w_out")  # the parameters split over ep

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        group: Group | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        if group is not None and not isinstance(group, Group):
            raise TypeError(
                f"group must be a gradsync_torch Group (ProcessGroups(...)['ep']) or None, got "
                f"{type(group).__name__}"
            )
        ep = 1 if group is None else group.size
        if num_experts < 1 or num_experts % ep:
            raise ValueError(
                f"num_experts = {num_experts} must be a positive multiple of the ep group size "
                f"{ep}, so every rank holds the same number of experts; change num_experts or ep"
            )
        self.num_experts, self.group = num_experts, group
        self.local_experts = num_experts // ep
        self.first_expert = 0 if group is None else group.group_rank * self.local_experts
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.w_in = nn.Parameter(torch.empty(self.local_experts, dim, hidden, **kw))
        self.w_out = nn.Parameter(torch.empty(self.local_experts, hidden, dim, **kw))
        self._declare()
        self.reset_parameters()

    def _declare(self) -> None:
        # On the parameters, not the module: ZeroRedundancyOptimizer sees them without it.
        # The experts are split over ep; no other axis shards them.
        for name in self.expert_params:
            getattr(self, name).gradsync_sharded_over = ("ep",)

    def __setstate__(self, state: dict) -> None:
        # copy.deepcopy and pickling rebuild the parameters without their attributes.
        super().__setstate__(state)
        self._declare()

    def reset_parameters(self) -> None:
        # nn.Linear's U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for each expert's two layers.
        for weight in (self.w_in, self.w_out):
            bound = 1.0 / math.sqrt(weight.shape[1])
            nn.init.uniform_(weight, -bound, bound)

    def local_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of the serial layer's ``name`` (all experts stacked)."""
        return full[self.first_expert : self.first_expert + self.local_experts].clone()

    def forward(
        self, tokens: torch.Tensor, expert_index: torch.Tensor, gate: torch.Tensor
    ) -> torch.Tensor:
        """``gate * expert(token)`` for tokens routed to an expert held here, zeros for others.

        Args:
            tokens: ``(n, dim)``; expert_index: ``(n,)`` global expert ids; gate: ``(n,)``.
        """
        out = torch.zeros_like(tokens)
        for local in range(self.local_experts):
            # No skip for an expert without tokens: the empty matmul still gives its weights
            # a (zero) gradient, so every rank reduces the same gradients.
            rows = (expert_index == self.first_expert + local).nonzero().squeeze(1)
            hidden = F.gelu(tokens[rows] @ self.w_in[local])
            out = out.index_add(0, rows, (hidden @ self.w_out[local]) * gate[rows, None])
        return out

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, local_experts={self.local_experts}, "
            f"first_expert={self.first_expert}"
        )


class MoE(nn.Module):
    """A top-1 mixture-of-experts MLP: a dense router and ``ExpertMLPs`` over ``ep``.

    The router (a bias-free ``nn.Linear``) is a dense parameter, averaged over ``dp`` like any
    other; the experts are expert parameters, averaged over ``edp``. Each token goes to the
    expert of highest router probability and its output is scaled by that probability.

    Args:
        dim, hidden, num_experts: model width, expert hidden width, experts of the layer.
        group: the ``ep`` group; ``None`` (or a group of one rank): the serial layer.
        device, dtype: as for ``nn.Linear``.

    Inputs have shape ``(..., dim)``; every rank of the ``ep`` group must pass the same number
    of tokens (the reduce-scatter returns equal chunks).

    Example:
        >>> moe = MoE(16, 32, num_experts=4, group=groups["ep"])  # ep = 2: 2 experts here
        >>> [s.expert for s in shared_param_specs(moe, data_axes=())]
        [False, True, True]
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        group: Group | None = None,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        kw: dict[str, Any] = {"device": device, "dtype": dtype}
        self.group = group if group is not None and group.size > 1 else None
        self.router = nn.Linear(dim, num_experts, bias=False, **kw)
        self.experts = ExpertMLPs(dim, hidden, num_experts, group, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        probs = torch.softmax(self.router(tokens), dim=-1)
        if self.group is not None:
            count = tokens.shape[0] * self.group.size
            tokens = all_gather_from(tokens, self.group, dim=0, size=count)
            probs = all_gather_from(probs, self.group, dim=0, size=count)
        expert_index = probs.argmax(dim=-1)
        gate = probs.gather(-1, expert_index[:, None]).squeeze(-1)
        out = self.experts(tokens, expert_index, gate)
        if self.group is not None:
            out = reduce_scatter_to(out, self.group, dim=0)
        return out.reshape(x.shape)
