"""mesh_from_topology: devices placed by rank; every mesh fibre is a core planner group."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import EXPERT_GROUPS, STANDARD_GROUPS, Topology
from gradsync_jax import mesh_from_topology

TOPOLOGIES = {
    "tp2-cp2-dp2": Topology.create(8, tp=2, cp=2),
    "dp8": Topology.create(8),
    "tp2-pp2-dp2": Topology.create(8, tp=2, pp=2),
    "ep2-dp4-order-dp-first": Topology.create(8, ep=2, order="dp-ep-tp-cp-pp"),
    "cp4-tp2-order-cp-tp": Topology.create(8, tp=2, cp=4, order="cp-tp-ep-dp-pp"),
}


def _device_order(kind: str) -> list:
    devices = sorted(jax.devices(), key=lambda d: d.id)
    # A scrambled list proves the mesh follows the given order, not jax.devices().
    return devices if kind == "sorted" else [devices[i] for i in (5, 2, 7, 0, 3, 6, 1, 4)]


def _groups_from_mesh(mesh, devices, axes: tuple[str, ...]) -> set[tuple[int, ...]]:
    rank_of = {d.id: r for r, d in enumerate(devices)}
    ranks = np.vectorize(lambda d: rank_of[d.id], otypes=[int])(mesh.devices)
    positions = [mesh.axis_names.index(a) for a in axes]
    rest = [i for i in range(ranks.ndim) if i not in positions]
    rows = np.transpose(ranks, rest + positions).reshape(
        -1, int(np.prod([mesh.shape[a] for a in axes]))
    )
    return {tuple(int(r) for r in row) for row in rows}


@pytest.mark.parametrize("kind", ["sorted", "scrambled"])
@pytest.mark.parametrize("topo", list(TOPOLOGIES.values()), ids=list(TOPOLOGIES))
def test_every_group_is_a_mesh_fibre(topo: Topology, kind: str) -> None:
    devices = _device_order(kind)
    mesh = mesh_from_topology(topo, devices)
    assert mesh.axis_names == topo.mesh_axis_names
    assert tuple(mesh.devices.shape) == topo.mesh_shape
    assert all(t == AxisType.Explicit for t in mesh.axis_types)
    assert [d.id for d in mesh.devices.flat] == [d.id for d in devices]  # rank r -> device r
    for name in STANDARD_GROUPS:
        if topo.is_expert_group(name):  # "ep" once experts are carved out of dp: below
            continue
        axes = topo.mesh_axes(name)
        got = _groups_from_mesh(mesh, devices, axes)
        assert got == set(topo.groups(name)), name
    if topo.has_experts:
        # The expert view: the expert generator's sizes, devices placed by rank the same way.
        expert_mesh = mesh_from_topology(topo, devices, expert=True)
        assert expert_mesh.axis_names == topo.expert_mesh_axis_names
        assert tuple(expert_mesh.devices.shape) == topo.expert_mesh_shape
        assert [d.id for d in expert_mesh.devices.flat] == [d.id for d in devices]
        for name in EXPERT_GROUPS:
            got = _groups_from_mesh(expert_mesh, devices, topo.mesh_axes(name))
            assert got == set(topo.groups(name)), name
        if topo.cp == 1 and topo.etp == topo.tp:
            # One shard_map over the expert mesh trains the dense part on edp and ep (in
            # mesh order: ("edp", "ep") for the default order).
            pair = tuple(a for a in expert_mesh.axis_names if a in ("edp", "ep"))
            dense_dp = _groups_from_mesh(expert_mesh, devices, pair)
            assert dense_dp == set(topo.groups("dp"))


@pytest.mark.parametrize("kind", ["sorted", "scrambled"])
def test_axis_index_is_group_rank_inside_shard_map(kind: str) -> None:
    """all_gather over the axis-name tuple lists the group in group-rank order."""
    topo = TOPOLOGIES["tp2-cp2-dp2"]
    devices = _device_order(kind)
    mesh = mesh_from_topology(topo, devices)
    names = [n for n in STANDARD_GROUPS if topo.group_size(n) > 1]
    spec = P(mesh.axis_names)

    def per_device(rank):
        out = []
        for name in names:
            axes = topo.mesh_axes(name)
            members = lax.all_gather(rank[0], axes, tiled=False)
            out.append(jnp.concatenate([members, lax.axis_index(axes)[None]])[None])
        return tuple(out)

    fn = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=spec, out_specs=spec))
    ranks = jax.device_put(jnp.arange(8, dtype=jnp.int32), NamedSharding(mesh, spec))
    results = fn(ranks)
    for name, result in zip(names, results, strict=True):
        result = np.asarray(result)
        for rank in range(8):
            # Row `rank` of the output lives on the device of that rank.
            *members, index = result[rank].tolist()
            assert tuple(members) == topo.group_of(name, rank), (name, rank)
            assert index == topo.group_rank(name, rank), (name, rank)


def test_axis_types_and_errors() -> None:
    topo = Topology.create(8, tp=2)
    assert mesh_from_topology(topo, axis_types=AxisType.Auto).axis_types == (AxisType.Auto,) * 5
    with pytest.raises(ValueError, match=r"needs world_size = 4 devices \(.*\), got 8"):
        mesh_from_topology(Topology.create(4))
    with pytest.raises(ValueError, match="twice"):
        mesh_from_topology(Topology.create(2), [jax.devices()[0]] * 2)
    with pytest.raises(ValueError, match="axis_types has 2 entries"):
        mesh_from_topology(topo, axis_types=(AxisType.Auto,) * 2)
    with pytest.raises(TypeError, match="Topology"):
        mesh_from_topology({"dp": 8})  # type: ignore[arg-type]
