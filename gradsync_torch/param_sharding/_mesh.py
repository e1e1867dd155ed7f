"""The 2-D mesh of hybrid sharding (HSDP) from a gradsync ``Topology``.

HSDP shards a model over the few ranks that share a fast link (one node) and replicates it
across the groups (all-reducing the sharded gradients between nodes), so the all-gathers stay
on the node. FSDP2 takes that as a 2-D ``DeviceMesh`` ``(replicate, shard)``; ``hsdp_mesh``
builds it from the data-parallel groups a ``Topology`` already names, as
``ProcessGroups.device_mesh`` does for the model-parallel axes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gradsync_core import Topology


def hsdp_mesh(topology: Topology, shard_size: int, *, device_type: str = "cpu") -> DeviceMesh:
    """The ``(replicate, shard)`` mesh of this rank's data-parallel group for ``fully_shard``.

    Each data-parallel group of ``topology`` (``topology.groups("dp")``, the whole world
    without model parallelism) is cut into shard groups of ``shard_size`` consecutive members
    (ranks are numbered node by node, so with ``shard_size`` = ranks per node a shard group is
    one node) and replicate groups of the members ``shard_size`` apart (one per node). Call it
    on every rank with the same arguments: ``dist.new_group`` is collective over the world.

    Args:
        topology: the parallel layout; its ``world_size`` must be the process group's.
        shard_size: ranks a parameter is cut over (e.g. the GPUs of a node); must divide
            ``topology.dp``.
        device_type: the mesh's device type (``"cuda"`` with NCCL).

    Raises:
        ValueError: ``shard_size`` does not divide the data-parallel size, or the topology
            does not match the world.

    Example:
        >>> mesh = hsdp_mesh(Topology.create(world_size=4), shard_size=2)  # doctest: +SKIP
        >>> fully_shard(model, mesh=mesh)  # doctest: +SKIP
    """
    world = dist.get_world_size()
    if topology.world_size != world:
        raise ValueError(
            f"the topology has {topology.world_size} ranks but the process group {world}; "
            "build the Topology with world_size=torch.distributed.get_world_size()"
        )
    if not isinstance(shard_size, int) or shard_size < 1 or topology.dp % shard_size:
        raise ValueError(
            f"shard_size {shard_size!r} must be a positive divisor of the data-parallel size "
            f"{topology.dp} (e.g. the ranks per node)"
        )
    rank = dist.get_rank()
    mine = None
    for ranks in topology.groups("dp"):  # every rank creates every group, in the same order
        grid = torch.tensor(ranks).reshape(-1, shard_size)
        shards = [dist.new_group(row.tolist()) for row in grid]
        replicas = [dist.new_group(col.tolist()) for col in grid.T]
        if rank in ranks:
            row, col = (int(x) for x in (grid == rank).nonzero()[0])
            mine = (grid, replicas[col], shards[row])
    assert mine is not None
    grid, replicate, shard = mine
    return DeviceMesh.from_group(
        [replicate, shard], device_type, grid, mesh_dim_names=("replicate", "shard")
    )
