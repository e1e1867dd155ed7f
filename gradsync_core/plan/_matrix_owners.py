"""Matrix-owner plans: which rank steps each matrix of a matrix optimizer, whole.

Muon (Jordan et al. 2024; torch's ``torch.optim.Muon``, Optax's ``optax.contrib.muon``)
orthogonalizes each weight matrix's momentum with Newton-Schulz iterations over the whole
matrix, so no rank may step a piece of one alone (docs/matrix-optimizers.md). The exact way is
to give every matrix one owner: the owner receives the matrix's whole gradient, runs the
optimizer's matrix step and hands every rank back its part. The owners are balanced by the
optimizer's work, not by bytes: one Newton-Schulz iteration on an ``m x n`` matrix costs
about ``m * n * min(m, n)`` multiply-adds (the Gram matrix of the short side, then two
products with it), so a square matrix costs more than a flat one of the same size (Megatron's
distributed Muon balances the same way). Both executors plan from the same specs in torch's
names and layouts, so torch and JAX pick the same owners (the same fingerprint).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._param_shards import chunk_rows
from gradsync_core.plan._shards import Shard, ShardPlan
from gradsync_core.plan._specs import ParamSpec, check_unique_names

# The cost functions a plan may balance: ``newton_schulz``: the multiply-adds of one
# Newton-Schulz iteration, ``m * n * min(m, n)`` per matrix (a batch of matrices, leading
# dimensions, times their number); ``numel``: elements, as an elementwise step costs.
MATRIX_COSTS = ("newton_schulz", "numel")


def matrix_cost(shape: Sequence[int], cost: str = "newton_schulz") -> int:
    """The work of one step on a parameter of ``shape`` under cost function ``cost``.

    Raises:
        ValueError: an unknown cost, or ``newton_schulz`` for a shape of fewer than 2 dims.

    Example:
        >>> matrix_cost((64, 256)), matrix_cost((64, 256), "numel")
        (1048576, 16384)
    """
    if cost not in MATRIX_COSTS:
        raise ValueError(f"cost must be one of {MATRIX_COSTS}, got {cost!r}")
    numel = math.prod(shape)
    if cost == "numel":
        return numel
    if len(shape) < 2:
        raise ValueError(
            f"a matrix optimizer steps matrices, but a parameter has shape {tuple(shape)}; "
            "give it to the elementwise optimizer (AdamW) instead"
        )
    return numel * min(shape[-2], shape[-1])


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnedMatrix:
    """Matrix ``name`` of ``shape`` (torch's layout) is stepped whole by rank ``owner``."""

    name: str
    shape: tuple[int, ...]
    owner: int
    cost: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class OwnerExchange:
    """Elements one rank sends and receives in one step of the owner path."""

    sent_numel: int
    received_numel: int


@dataclass(frozen=True, slots=True, kw_only=True)
class MatrixOwnerPlan:
    """The owner of every matrix, balanced by ``cost`` over ``world_size`` ranks.

    ``matrices`` are sorted by name: neither they nor their owners depend on the order the
    specs came in (torch's registration order, a Flax tree's sorted one), so one model gives
    one plan, and one fingerprint, in both frameworks.
    """

    world_size: int
    cost: str
    matrices: tuple[OwnedMatrix, ...]

    def owner(self, name: str) -> int:
        """The rank that steps matrix ``name``.

        Raises:
            KeyError: if ``name`` is not a matrix of this plan.
        """
        for matrix in self.matrices:
            if matrix.name == name:
                return matrix.owner
        raise KeyError(f"{name!r} is not a matrix of this plan (an elementwise parameter?)")

    def owned(self, rank: int) -> tuple[OwnedMatrix, ...]:
        """The matrices ``rank`` steps, by name."""
        return tuple(m for m in self.matrices if m.owner == rank)

    @property
    def rank_cost(self) -> tuple[int, ...]:
        """The planned work of each rank."""
        loads = [0] * self.world_size
        for matrix in self.matrices:
            loads[matrix.owner] += matrix.cost
        return tuple(loads)

    @property
    def imbalance(self) -> float:
        """``max / mean - 1`` of the ranks' work: 0.0 is perfect balance."""
        loads = self.rank_cost
        total = sum(loads)
        return max(loads) * len(loads) / total - 1.0 if total else 0.0

    def shard_plan(self) -> ShardPlan:
        """The same owners as a whole-tensor ``ShardPlan`` (kind ``"greedy"``): what a
        checkpoint records, so any saver's format reads it."""
        shards = tuple(
            Shard(name=m.name, rank=m.owner, start=0, stop=m.numel, group=0) for m in self.matrices
        )
        return ShardPlan(kind="greedy", world_size=self.world_size, shards=shards)

    def rows_exchange(
        self, rank: int, *, with_params: bool = True, state_leaves: int = 0
    ) -> OwnerExchange:
        """What ``rank`` moves per step when every matrix is cut into dim-0 rows over the
        ranks (ZeRO-3, ``chunk_rows``): each rank sends each owner its rows of the gradient
        (and of the parameter, ``with_params``) and receives its updated rows back.
        ``state_leaves``: optimizer-state tensors per matrix that are kept in rows too (JAX's
        ``zero3_step``: Muon's momentum), each sent to the owner and received back.

        Example:
            >>> plan = plan_matrix_owners([ParamSpec(name="w", shape=(4, 3))], world_size=2)
            >>> plan.rows_exchange(0)
            OwnerExchange(sent_numel=6, received_numel=12)
            >>> plan.rows_exchange(1)
            OwnerExchange(sent_numel=12, received_numel=6)
        """
        inbound = (2 if with_params else 1) + state_leaves
        outbound = 1 + state_leaves
        sent = received = 0
        for m in self.matrices:
            row = math.prod(m.shape[1:])
            start, stop, _ = chunk_rows(m.shape[0], self.world_size, rank)
            mine = (stop - start) * row
            if m.owner == rank:
                received += inbound * (m.numel - mine)
                sent += outbound * (m.numel - mine)
            else:
                sent += inbound * mine
                received += outbound * mine
        return OwnerExchange(sent_numel=sent, received_numel=received)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "matrix_owner_plan",
            "version": PLAN_VERSION,
            "world_size": self.world_size,
            "cost": self.cost,
            "matrices": [[m.name, list(m.shape), m.owner, m.cost] for m in self.matrices],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> MatrixOwnerPlan:
        check_header(obj, "matrix_owner_plan")
        return cls(
            world_size=obj["world_size"],
            cost=obj["cost"],
            matrices=tuple(
                OwnedMatrix(name=name, shape=tuple(shape), owner=owner, cost=cost)
                for name, shape, owner, cost in obj["matrices"]
            ),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def plan_matrix_owners(
    specs: Sequence[ParamSpec], *, world_size: int, cost: str = "newton_schulz"
) -> MatrixOwnerPlan:
    """Give each trainable matrix in ``specs`` one owner, balancing ``cost`` over the ranks.

    Longest processing time first (Graham 1969): matrices by cost, largest first (equal
    costs by name, so the owners do not depend on the order the specs come in), each to the
    rank with the least work so far (ties: the lowest rank). No rank then exceeds the mean by
    more than one matrix's cost, and with many matrices per rank the spread is a few percent.

    Args:
        specs: the parameters the matrix optimizer steps, in torch's names and layouts
            (frozen ones get no owner).
        world_size: ranks sharing the work (the data-parallel shard size).
        cost: a name in ``MATRIX_COSTS``.

    Raises:
        ValueError: a bad world size or cost, duplicate names, or (``newton_schulz``) a
            parameter of fewer than 2 dims.

    Example:
        >>> specs = [ParamSpec(name=n, shape=s) for n, s in
        ...          [("qkv", (48, 16)), ("proj", (16, 16)), ("fc", (64, 16))]]
        >>> plan = plan_matrix_owners(specs, world_size=2)
        >>> [(m.name, m.owner) for m in plan.matrices], plan.rank_cost
        ([('fc', 0), ('proj', 1), ('qkv', 1)], (16384, 16384))
    """
    if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    check_unique_names(list(specs))
    trainable = [s for s in specs if s.requires_grad]
    costs = {s.name: matrix_cost(s.shape, cost) for s in trainable}
    loads = [(0, rank) for rank in range(world_size)]
    owner: dict[str, int] = {}
    for spec in sorted(trainable, key=lambda s: (-costs[s.name], s.name)):
        load, rank = loads[0]
        owner[spec.name] = rank
        heapq.heapreplace(loads, (load + costs[spec.name], rank))
    return MatrixOwnerPlan(
        world_size=world_size,
        cost=cost,
        matrices=tuple(
            OwnedMatrix(name=s.name, shape=s.shape, owner=owner[s.name], cost=costs[s.name])
            for s in sorted(trainable, key=lambda s: s.name)
        ),
    )
