"""The shared-parameter gradient sums of model parallelism (docs/design.md §6).

A parameter replicated over a model-parallel group (a LayerNorm under tensor parallelism,
every parameter under context parallelism, an expert over ``edp``) gets a partial gradient on
each member; ``gradsync_core.plan_shared_reductions`` plans one bucketed sum per group and
these functions execute it inside ``jax.shard_map``. The data-parallel sync calls them after
its mean (the sums commute with it), and model parallelism plans them, so they sit below both.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from jax import lax
from jax.sharding import Mesh

from gradsync_core import ReductionPlan
from gradsync_jax._axes import tracks_variance, varying
from gradsync_jax._specs import leaf_names


def _leaf_groups(
    tree: Any, plan: ReductionPlan, names: Sequence[str] | None
) -> tuple[list[Any], Any, list[str]]:
    leaves, treedef = jax.tree_util.tree_flatten(tree)
    names = leaf_names(tree, names)
    plan.check_names(names, where="a leaf here (plan it with shared_param_specs of this tree)")
    return leaves, treedef, names


def make_shared_local(
    params: Any, plan: ReductionPlan, *, names: Sequence[str] | None = None
) -> Any:
    """Mark each planned parameter varying over its reduction group's axes (``lax.pcast``).

    Differentiate w.r.t. the result inside ``shard_map`` and each device gets its PARTIAL
    gradient of a replicated parameter, which ``reduce_shared_gradients`` then sums once per
    step (bucketed, and after gradient accumulation rather than in every micro-step).
    Without it JAX sums at every use (the transpose of its implicit broadcast) and
    ``reduce_shared_gradients`` refuses the already-summed gradients.

    Example:
        >>> grads = jax.grad(loss)(make_shared_local(make_local(params, "dp"), plan), x)
    """
    leaves, treedef, names = _leaf_groups(params, plan, names)
    group_of = {name: r.group for r in plan.reductions for name in r.names}
    out = []
    for name, leaf in zip(names, leaves, strict=True):
        group = group_of.get(name)
        if group is not None:
            missing = tuple(a for a in plan.topology.mesh_axes(group) if a not in varying(leaf))
            if missing and tracks_variance(missing):
                leaf = lax.pcast(leaf, missing, to="varying")
        out.append(leaf)
    return jax.tree_util.tree_unflatten(treedef, out)


def reduce_shared_gradients(
    grads: Any, plan: ReductionPlan, *, names: Sequence[str] | None = None
) -> Any:
    """Sum partial gradients of replicated parameters over their groups (docs/design.md §6).

    Call inside ``shard_map`` after differentiating w.r.t. ``make_shared_local(params, plan)``,
    before or after the data-parallel mean (they commute). Each bucket of the plan is one
    variadic ``psum`` (no flattening copies); unplanned leaves pass through. The expert
    reduction (group ``"edp"``) is divided by its ``divisor``, the dense dp: expert gradients
    must be left out of the data-parallel mean (``data_parallel_step`` does that).

    Args:
        grads: gradient pytree with leaves named as in the plan (``path_name``).
        plan: ``plan_shared_reductions(shared_param_specs(...), topology)``.
        names: plan names of the leaves in flattening order, if not ``path_name``.

    Raises:
        ValueError: if the plan names an unknown leaf, or a planned gradient is already
            invariant over its group (JAX summed it: params were not made local, and a psum
            would count it again).
    """
    leaves, treedef, names = _leaf_groups(grads, plan, names)
    position = {name: i for i, name in enumerate(names)}
    out = list(leaves)
    for reduction in plan.reductions:
        axes = plan.topology.mesh_axes(reduction.group)
        tracked = tracks_variance(axes)
        for bucket in reduction.buckets.buckets:
            members = [position[slot.name] for slot in bucket.slots]
            for i in members:
                if tracked and not set(axes) <= varying(leaves[i]):
                    raise ValueError(
                        f"gradient {names[i]!r} is already invariant over {axes}: JAX summed it "
                        "because its parameter was replicated there, and a psum would count it "
                        f"again. Differentiate w.r.t. make_shared_local(params, plan)."
                    )
            summed = lax.psum(tuple(leaves[i] for i in members), axes)
            for i, value in zip(members, summed, strict=True):
                # Expert gradients: summed over edp, divided by the dense dp (docs/design.md §6).
                out[i] = value if reduction.divisor == 1 else value / reduction.divisor
    return jax.tree_util.tree_unflatten(treedef, out)


def expert_names(plan: ReductionPlan | None) -> frozenset[str]:
    """The parameters of ``plan``'s expert reduction (group ``"edp"``): their gradients are
    left out of the data-parallel mean and summed over ``edp`` divided by the dense dp."""
    if plan is None or "edp" not in plan.group_names:
        return frozenset()
    return frozenset(plan.reduction("edp").names)


def check_plan_mesh(plan: ReductionPlan, mesh: Mesh) -> None:
    """Refuse a shared reduction plan made for another topology or the other mesh.

    Raises:
        ValueError: if the mesh's axis sizes are not the plan topology's (the expert
            generator's on the expert mesh, the dense one's otherwise), or a group of the
            plan lives on the other of Megatron-core's two meshes.
    """
    topology = plan.topology
    expert_mesh = "edp" in mesh.axis_names
    # The dense generator's sizes have ep = 1 once experts are carved out of dp.
    sizes = topology.mesh_sizes(expert=expert_mesh)
    if any(mesh.shape.get(a, 1) != n for a, n in sizes.items()):
        raise ValueError(
            f"the shared reduction plan was made for axes {sizes} but the mesh has "
            f"{dict(mesh.shape)}; plan it with the mesh's topology "
            "(mesh_from_topology(topology) and plan_shared_reductions(..., topology))"
        )
    for group in plan.group_names:
        if topology.is_expert_group(group) != expert_mesh:
            need = "the expert mesh" if topology.is_expert_group(group) else "the dense mesh"
            raise ValueError(
                f"the shared reduction plan sums over group {group!r}, which lives on {need}, "
                f"but the mesh has axes {mesh.axis_names}; build the mesh with "
                f"mesh_from_topology(topology, expert={not expert_mesh}) (one shard_map runs "
                "over one of Megatron-core's two layouts: an MoE model with cp = 1 and etp = tp "
                "trains on the expert mesh)"
            )
