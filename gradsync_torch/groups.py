"""Process groups named by a ``Topology``: the top of the torch executor (docs/design.md §5).

Every parallelism uses them: data parallelism takes ``groups["dp"]``, the model-parallel
layers their ``tp``/``cp``/``ep`` groups, the shared-parameter sums (``shared_reductions``) the
groups of their plan. So they sit here, below all of them, as torchtitan's ``ParallelDims``
and picotron's process-group manager do.

``dist.new_group`` is collective over the whole world: every rank must call it for every
group, members or not, in the same order, or ranks pair up the wrong groups and hang. So
``ProcessGroups`` walks ``Topology.groups(name)`` for every requested name identically on
every rank. A group whose ranks were already created (``tp-cp`` equals ``tp`` when cp=1) reuses
that process group, the whole world reuses ``dist.group.WORLD``, and a group of one rank gets
no process group at all: singleton axes cost nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from gradsync_core import AXES, EXPERT_GROUPS, STANDARD_GROUPS, Topology
from gradsync_core.plan import HSDP_AXES


@dataclass(frozen=True, eq=False)
class Group:
    """This rank's group of one name: its global ``ranks`` and this rank's ``group_rank``.

    A group of one rank has no process group (it costs nothing); the mappings and the
    reductions skip it, and ``process_group`` raises rather than return ``None``, which
    torch.distributed would read as "the whole world".
    """

    name: str
    ranks: tuple[int, ...]
    group_rank: int
    pg: ProcessGroup | None  # None exactly when size == 1; prefer process_group

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def process_group(self) -> ProcessGroup:
        """The torch process group.

        Raises:
            ValueError: for a group of one rank (check ``size`` first: nothing to do there).
        """
        if self.pg is None:
            raise ValueError(
                f"group {self.name!r} has one rank ({self.ranks[0]}) and no process group; "
                "skip the collective when size == 1 (passing None to torch.distributed "
                "would mean the whole world)"
            )
        return self.pg

    @property
    def axes(self) -> tuple[str, ...]:
        """The topology axes this group varies, e.g. ``("tp", "cp")``."""
        return tuple(self.name.split("-"))

    def __repr__(self) -> str:
        return f"Group({self.name!r}, ranks={self.ranks}, group_rank={self.group_rank})"


def _key(name: str) -> frozenset[str]:
    return frozenset(name.split("-"))


class ProcessGroups:
    """Every named group of a ``Topology`` for this rank (call on every rank, same arguments).

    Args:
        topology: sizes and order of the parallel axes; ``topology.world_size`` must equal
            the default group's world size.
        names: group names to create besides the single axes (``"tp"``, ``"cp"``, ...,
            and under HSDP ``"dp_shard"`` and ``"dp_replicate"``), which are always
            created. Default ``STANDARD_GROUPS``; add the groups of a ``ReductionPlan`` with
            ``names=STANDARD_GROUPS + plan.group_names`` (spellings are sets of axes:
            ``"cp-tp"`` is ``"tp-cp"``).

    Raises:
        RuntimeError: if torch.distributed is not initialized.
        ValueError: if the world size differs from the topology's, or a name is invalid.

    Example:
        >>> groups = ProcessGroups(Topology.create(dist.get_world_size(), tp=2))
        >>> groups.size("tp"), groups.group_rank("tp"), groups.ranks("dp")
        (2, 0, (0, 2))
    """

    def __init__(self, topology: Topology, names: Iterable[str] = STANDARD_GROUPS) -> None:
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialized: call dist.init_process_group first"
            )
        world = dist.get_world_size()
        if world != topology.world_size:
            raise ValueError(
                f"the topology needs {topology.world_size} ranks ({topology.order}: "
                f"{', '.join(f'{t}={getattr(topology, t)}' for t in topology.tokens)}) but "
                f"the process group has {world}; build it with Topology.create({world}, ...)"
            )
        self.topology = topology
        self.rank = dist.get_rank()
        self._groups: dict[frozenset[str], Group] = {}
        created: dict[tuple[int, ...], ProcessGroup] = {}
        # With experts, Megatron-core's expert groups too (edp reduces expert gradients);
        # under HSDP the two parts of dp (torchtitan's dp_shard and dp_replicate).
        extra = [n for n in EXPERT_GROUPS if n not in AXES] if topology.has_experts else []
        axes = list(AXES) + (list(HSDP_AXES) if topology.hsdp else [])
        ordered = axes + [n for n in [*names, *extra] if n not in axes]
        for name in ordered:
            key = _key(name)
            if key in self._groups:
                continue
            topology.group_size(name)  # validates the name
            mine = topology.group_of(name, self.rank)
            if len(mine) > 1:
                for ranks in topology.groups(name):
                    if ranks in created:
                        continue
                    if len(ranks) == world:
                        created[ranks] = cast(dist.ProcessGroup, dist.group.WORLD)
                    else:
                        created[ranks] = dist.new_group(list(ranks))
            self._groups[key] = Group(
                name=name,
                ranks=mine,
                group_rank=mine.index(self.rank),
                pg=created.get(mine) if len(mine) > 1 else None,
            )

    def group(self, name: str) -> Group:
        """This rank's group of ``name``.

        Raises:
            KeyError: if ``name`` was not requested at construction.
        """
        try:
            return self._groups[_key(name)]
        except KeyError:
            raise KeyError(
                f"group {name!r} was not created; pass it in names= when building "
                f"ProcessGroups (created: {sorted(g.name for g in self._groups.values())})"
            ) from None

    __getitem__ = group

    def __iter__(self) -> Iterator[Group]:
        return iter(self._groups.values())

    def size(self, name: str) -> int:
        return self.group(name).size

    def group_rank(self, name: str) -> int:
        """This rank's position in its ``name`` group (torch's group-local rank)."""
        return self.group(name).group_rank

    def ranks(self, name: str) -> tuple[int, ...]:
        """The global ranks of this rank's ``name`` group, ascending."""
        return self.group(name).ranks

    def device_mesh(
        self, device_type: str = "cpu", *, expert: bool = False
    ) -> dist.device_mesh.DeviceMesh:
        """A ``DeviceMesh`` over the axes of size > 1, reusing these process groups.

        Dimensions follow ``topology.mesh_axis_names`` (reversed order string, so the last
        dimension varies fastest) with singleton axes dropped, as torchtitan's
        ``ParallelDims.build_mesh`` does; ``mesh[name].get_group()`` is ``group(name)``'s
        process group. Under HSDP dp is the two dimensions ``("dp_replicate", "dp_shard")``:
        with only data parallelism the mesh is the 2-D one ``fully_shard`` takes for HSDP.
        A world of one rank gives a 1-D mesh named ``"dp"``. With ``expert=True``, the mesh
        of Megatron-core's expert generator instead: dimensions from
        ``topology.expert_mesh_axis_names`` (``pp``, ``edp``, ``ep``, ``etp``), the same ranks
        seen through the expert groups (two meshes, as ``gradsync_jax``'s
        ``mesh_from_topology(..., expert=True)``; docs/model-parallel.md).
        """
        from torch.distributed.device_mesh import DeviceMesh

        topo = self.topology
        sizes = topo.mesh_sizes(expert=expert)
        names = [a for a, size in sizes.items() if size > 1]
        mesh = torch.arange(topo.world_size).reshape([sizes[a] for a in names] or [1])
        if not names:
            world = cast(dist.ProcessGroup, dist.group.WORLD)
            return DeviceMesh.from_group(world, device_type, mesh_dim_names=("dp",))
        pgs = [self.group(a).process_group for a in names]
        return DeviceMesh.from_group(pgs, device_type, mesh, mesh_dim_names=tuple(names))
