"""A ``jax.sharding.Mesh`` from a gradsync ``Topology``, devices placed by rank (docs/design.md §5).

The topology's rank of a device is its position in the device list (default: ``jax.devices()``
sorted by id, which is the global list in a multi-process job). The mesh array is
``devices[arange(world_size).reshape(topology.mesh_shape)]``, so every fibre of the mesh is a
group of ``Topology.groups(name)`` and, for a multi-axis group, the ``lax.axis_index`` of the
axis-name tuple ``topology.mesh_axes(name)`` equals the group-local rank. Never
``jax.devices()`` order: that order is a backend detail and two frameworks must agree.

Mixture of experts: Megatron-core's two rank generators give two views of the same devices,
so there are two meshes (``expert=False``/``True``), never one mesh mixing them: the expert
mesh has axes ``topology.expert_mesh_axis_names`` (``("pp", "edp", "ep", "etp")``). With
``cp = 1`` and ``etp = tp`` the dense data-parallel group is the axis pair ``edp``, ``ep`` of
the expert mesh (in mesh order: ``("edp", "ep")`` for the default order), so a whole MoE
model trains in one ``shard_map`` over the expert mesh: the batch on ``("edp", "ep")``, the
experts on ``"ep"`` (``data_parallel_step`` there).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from gradsync_core import Topology


def _sizes(topology: Topology) -> str:
    return ", ".join(f"{t}={getattr(topology, t)}" for t in topology.tokens)


def mesh_from_topology(
    topology: Topology,
    devices: Sequence[Any] | None = None,
    *,
    axis_types: AxisType | Sequence[AxisType] = AxisType.Explicit,
    expert: bool = False,
) -> Mesh:
    """Build the mesh of ``topology``: device ``i`` of ``devices`` gets rank ``i``.

    Axis names are ``topology.mesh_axis_names`` (all five axes, size-1 ones included, so
    every group name resolves: ``("pp", "dp", "ep", "cp", "tp")`` for the default order).
    Under hybrid sharding (``Topology.create(..., dp_shard=S)``) dp is two axes,
    ``("pp", "dp_replicate", "dp_shard", "ep", "cp", "tp")``: the mesh of HSDP, on which
    ``zero3_step`` and ``shard_params`` read ``"dp"`` as the two (docs/jax-zero3.md).
    With ``expert=True`` the mesh of Megatron-core's expert generator instead: axes
    ``topology.expert_mesh_axis_names`` (``("pp", "edp", "ep", "etp")``), whose fibres are
    the expert groups (see the module docstring).

    Args:
        topology: sizes and order of the parallel axes; its ``world_size`` must equal the
            number of devices.
        devices: devices in rank order; default ``jax.devices()`` sorted by ``id`` (all
            processes' devices after ``jax.distributed.initialize``).
        axis_types: one ``jax.sharding.AxisType`` for every axis, or one per mesh axis.
            Default ``Explicit``, as ``jax.make_mesh``: inputs of a ``shard_map`` must then be
            placed with ``jax.device_put``/``jax.reshard`` (``data_parallel_step`` does it).

    Returns:
        A ``jax.sharding.Mesh`` with ``mesh.devices.flat[rank]`` the device of ``rank``.

    Raises:
        ValueError: if the device count differs from ``topology.world_size``, a device is
            listed twice, or ``axis_types`` has the wrong length.

    Example:
        >>> topo = Topology.create(world_size=8, tp=2, cp=2)
        >>> mesh = mesh_from_topology(topo)
        >>> mesh.shape["dp"], topo.mesh_axes("dp-cp")
        (2, ('dp', 'cp'))
        >>> moe = Topology.create(world_size=8, ep=2)
        >>> dict(mesh_from_topology(moe, expert=True).shape)
        {'pp': 1, 'edp': 4, 'ep': 2, 'etp': 1}
        >>> hsdp = mesh_from_topology(Topology.create(world_size=8, dp_shard=4))
        >>> hsdp.shape["dp_replicate"], hsdp.shape["dp_shard"]
        (2, 4)
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be a gradsync_core.Topology, got {type(topology)!r}")
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: d.id)
    devices = list(devices)
    if len(devices) != topology.world_size:
        raise ValueError(
            f"the topology needs world_size = {topology.world_size} devices "
            f"({topology.order}: {_sizes(topology)}), got {len(devices)}; pass "
            f"devices=... or build it with Topology.create(world_size={len(devices)}, ...)"
        )
    if len({id(d) for d in devices}) != len(devices):
        raise ValueError("devices lists a device twice; every rank needs its own device")
    sizes = topology.mesh_sizes(expert=expert)
    names, shape = tuple(sizes), tuple(sizes.values())
    if isinstance(axis_types, AxisType):
        types = (axis_types,) * len(names)
    else:
        types = tuple(axis_types)
        if len(types) != len(names):
            raise ValueError(
                f"axis_types has {len(types)} entries but the mesh has {len(names)} axes {names}"
            )
    array = np.empty(len(devices), dtype=object)
    array[:] = devices  # element-wise: np.array(devices) could try to unpack device objects
    ranks = np.arange(topology.world_size).reshape(shape)
    return Mesh(array[ranks], names, axis_types=types)
