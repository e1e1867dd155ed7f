"""The 2-D mesh of hybrid sharding (HSDP) from a gradsync ``Topology``.

HSDP shards a model over the few ranks that share a fast link (one node) and replicates it
across the groups (all-reducing the sharded gradients between nodes), so the all-gathers stay
on the node. FSDP2 takes that as a 2-D ``DeviceMesh`` ``(replicate, shard)``; the split is the
topology's (``Topology.dp_shard``, torchtitan's ``ParallelDims.dp_shard``), whose groups
``"dp_shard"`` and ``"dp_replicate"`` ``hsdp_mesh`` creates, as ``ProcessGroups`` creates the
others (``ProcessGroups(topology).device_mesh()`` has the same two dimensions, named after
the topology's axes).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from gradsync_core import Topology
from gradsync_core.deprecation import deprecated_keywords, warn_deprecated


@deprecated_keywords(shard_size="hsdp_mesh(Topology.create(..., dp_shard=...))")
def hsdp_mesh(
    topology: Topology, shard_size: int | None = None, *, device_type: str = "cpu"
) -> DeviceMesh:
    """The ``(replicate, shard)`` mesh of this rank's data-parallel group for ``fully_shard``.

    The topology's ``dp_shard`` cuts each data-parallel group (``topology.groups("dp")``, the
    whole world without model parallelism) into shard groups of ``dp_shard`` consecutive
    members (ranks are numbered node by node, so with ``dp_shard`` = ranks per node a shard
    group is one node), ``topology.groups("dp_shard")``, and replicate groups of the members
    ``dp_shard`` apart (one per node), ``topology.groups("dp_replicate")``. Call it on every
    rank with the same arguments: ``dist.new_group`` is collective over the world.

    Args:
        topology: the parallel layout, HSDP's split included
            (``Topology.create(world_size, dp_shard=8)``); its ``world_size`` must be the
            process group's. Without a split (``dp_shard = dp``) one replica: plain sharding.
        shard_size: deprecated: build the topology with ``dp_shard=shard_size`` instead.
        device_type: the mesh's device type (``"cuda"`` with NCCL).

    Raises:
        ValueError: the topology does not match the world, or ``shard_size`` does not
            divide the data-parallel size or contradicts the topology's ``dp_shard``.

    Example:
        >>> mesh = hsdp_mesh(Topology.create(world_size=4, dp_shard=2))  # doctest: +SKIP
        >>> fully_shard(model, mesh=mesh)  # doctest: +SKIP
    """
    world = dist.get_world_size()
    if topology.world_size != world:
        raise ValueError(
            f"the topology has {topology.world_size} ranks but the process group {world}; "
            "build the Topology with world_size=torch.distributed.get_world_size()"
        )
    if shard_size is not None:
        if not isinstance(shard_size, int) or shard_size < 1 or topology.dp % shard_size:
            raise ValueError(
                f"shard_size {shard_size!r} must be a positive divisor of the data-parallel "
                f"size {topology.dp} (e.g. the ranks per node)"
            )
        if topology.hsdp and topology.dp_shard != shard_size:
            raise ValueError(
                f"shard_size {shard_size} contradicts the topology's dp_shard "
                f"{topology.dp_shard}; leave shard_size out (the topology has the split)"
            )
        warn_deprecated(
            "hsdp_mesh(topology, shard_size)", "hsdp_mesh(Topology.create(..., dp_shard=...))"
        )
        topology = dataclasses.replace(topology, dp_shard=shard_size)
    rank = dist.get_rank()
    created = {}
    for name in ("dp_shard", "dp_replicate"):  # every rank creates every group, in one order
        for ranks in topology.groups(name):
            created[name, ranks] = dist.new_group(list(ranks))
    grid = torch.tensor(topology.group_of("dp", rank)).reshape(
        topology.size("dp_replicate"), topology.size("dp_shard")
    )
    replicate = created["dp_replicate", topology.group_of("dp_replicate", rank)]
    shard = created["dp_shard", topology.group_of("dp_shard", rank)]
    return DeviceMesh.from_group(
        [replicate, shard], device_type, grid, mesh_dim_names=("replicate", "shard")
    )
