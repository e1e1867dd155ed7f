"""A jitted data-parallel training step: batch sharded over ``dp``, parameters replicated
(or sharded over model-parallel axes, with the derived shared-parameter sums, docs/design.md §6)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import BucketPlan, ReductionPlan
from gradsync_jax._accumulate import accumulate_local_grads
from gradsync_jax._axes import AxisName, axis_tuple, display_axis, spec_entry_axes
from gradsync_jax._specs import leaf_names
from gradsync_jax._sync import sync_gradients
from gradsync_jax.model_parallel.mappings import make_shared_local, reduce_shared_gradients
from gradsync_jax.zero.transform import ShardedOptimizer

StepFn = Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]


@dataclass(frozen=True, slots=True, kw_only=True)
class _Placement:
    """How the step's inputs are laid out over the mesh (the ``shard_map`` specs)."""

    axes: tuple[str, ...]  # the data-parallel axes
    dp_size: int
    batch_spec: P
    token_axes: tuple[str, ...]  # axes after the batch dimension: they split the tokens
    param_specs: Any  # a PartitionSpec tree, or P() for everything replicated


def data_parallel_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: AxisName = "dp",
    reduce: str = "mean",
    reduce_dtype: Any = None,
    plan: BucketPlan | None = None,
    accumulate_steps: int = 1,
    param_specs: Any = None,
    batch_spec: P | None = None,
    shared: ReductionPlan | None = None,
    loss_as: str | None = None,
) -> StepFn:
    """Build ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

    Inside one ``jax.shard_map`` over ``mesh``: each device computes LOCAL gradients of its
    batch shard (``accumulate_steps`` micro-steps without communication), gradsync reduces
    them once over ``axis_name`` (docs/design.md §7: no implicit ``psum``, no double count), and the
    Optax update runs identically on every device. The user never sees ``pcast``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean over its (local) batch.
        tx: any Optax transformation; ``opt_state = tx.init(params)``. A
            ``shard_optimizer(...)`` (ZeRO) is taken as is: it gets the local gradients and
            reduce-scatters them itself, and its state carries ``tx.state_specs(params)``.
        mesh: e.g. ``mesh_from_topology(Topology.create(len(jax.devices())))``.
        axis_name: the mesh axis (or tuple of axes) the batch is sharded over.
        reduce, reduce_dtype, plan: passed to ``sync_gradients``.
        accumulate_steps: split each device's batch into this many micro-batches and sync
            once; the step then equals one step on the whole batch.
        param_specs: model parallelism: a ``PartitionSpec`` tree matching ``params``
            (``nnx_functional(model)[2]``); default every parameter replicated (``P()``).
            The optimizer state's specs are derived from it (``optax.tree_map_params``).
        batch_spec: the batch's ``PartitionSpec``; its first entry must be ``axis_name``.
            Default ``P(axis_name)``. Further axes split the tokens (``P("dp", "cp")``,
            ``P("dp", ("cp", "tp"))`` under sequence parallelism); ``loss_fn`` then returns
            this device's SHARE of its data-parallel replica's loss (divide by the replica's
            token count), and the reported loss sums the shares over those axes.
        shared: the shared-parameter sums, ``plan_shared_reductions(shared_param_specs(
            params, param_specs, data_spec=batch_spec, mesh=mesh), topology)``: planned
            gradients stay partial through accumulation and are summed over their groups
            once, bucketed, after the dp mean (without it JAX's implicit ``psum`` at every
            use gives the same values, one collective per use and micro-step). Expert
            parameters (the plan's ``"edp"`` reduction, e.g. ``MoE``'s experts) are left out
            of the dp mean and summed over ``edp`` divided by the dense dp instead; they need
            the expert mesh (``mesh_from_topology(topology, expert=True)``) with the batch on
            its ``edp`` and ``ep`` axes (``axis_name=("edp", "ep")``), and ``reduce="mean"``.
        loss_as: pass the global mean loss to ``tx.update`` as this keyword argument of an
            ``optax.GradientTransformationExtraArgs``: ``"value"`` for ``optax.polyak_sgd``
            and ``optax.contrib.reduce_on_plateau``. Default: no extra argument.

    Returns:
        ``step``; ``batch`` is a pytree whose leaves share a leading dimension divisible by
        ``dp_size * accumulate_steps``; ``loss`` is the mean over the global batch.

    Raises:
        ValueError: if ``axis_name`` is not a mesh axis, ``batch_spec`` does not start with
            it, ``shared`` was planned for another topology, the optimizer state's specs
            cannot be derived from ``param_specs``, or (when called) the batch does not
            split evenly.

    Example:
        >>> mesh = mesh_from_topology(Topology.create(8))
        >>> step = data_parallel_step(loss_fn, optax.adam(1e-3), mesh)
        >>> params, opt_state, loss = step(params, tx.init(params), batch)
    """
    axes = axis_tuple(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis {missing[0]!r} is not an axis of the mesh {mesh.axis_names}")
    if loss_as is not None and not (isinstance(loss_as, str) and loss_as.isidentifier()):
        raise ValueError(
            f"loss_as must be the name of tx.update's keyword argument for the loss, such as "
            f"'value', got {loss_as!r}"
        )
    if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
        raise ValueError(f"accumulate_steps must be a positive int, got {accumulate_steps!r}")
    placement = _placement(mesh, axes, axis_name, batch_spec, param_specs)
    if shared is not None:
        _check_topology(shared, mesh)
    experts = _expert_names(shared)
    if experts:
        _check_expert_step(shared, placement, reduce)  # type: ignore[arg-type]
    zero = isinstance(tx, ShardedOptimizer)
    if zero:
        _check_sharded_optimizer(
            tx,
            mesh,
            axes,
            reduce,
            plan is not None
            or reduce_dtype is not None
            or shared is not None
            or param_specs is not None,
        )

    # A plain GradientTransformation ignores the loss; an ExtraArgs one takes it by name.
    update = tx.update if loss_as is None else optax.with_extra_args_support(tx).update

    def local_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        # Planned parameters vary over their groups, so their gradients stay partial through
        # the micro-steps and sync_gradients sums them once.
        local = params if shared is None else make_shared_local(params, shared)
        loss, grads = accumulate_local_grads(
            loss_fn, local, batch, accumulate_steps, axis_name=axis_name
        )
        if experts:
            grads = _sync_dense_then_shared(
                grads, axis_name, reduce, reduce_dtype, plan, shared, experts
            )
        elif not zero:  # a ShardedOptimizer reduce-scatters the local gradients itself
            grads = sync_gradients(
                grads,
                axis_name,
                reduce=reduce,
                reduce_dtype=reduce_dtype,
                plan=plan,
                shared=shared,
            )
        if placement.token_axes:  # each device holds its share of its replica's loss
            loss = lax.psum(loss, placement.token_axes)
        loss = lax.pmean(loss, axis_name)  # the global mean: the same on every device
        extra_args = {} if loss_as is None else {loss_as: loss}
        updates, opt_state = update(grads, opt_state, params, **extra_args)
        return optax.apply_updates(params, updates), opt_state, loss

    mapped = _mapped_step(
        local_step, tx, mesh, placement, derive_state_specs=param_specs is not None
    )
    multiple = placement.dp_size * accumulate_steps

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        for leaf in jax.tree.leaves(batch):
            if leaf.ndim == 0 or leaf.shape[0] % multiple:
                raise ValueError(
                    f"a batch leaf has shape {leaf.shape}; its leading dimension must be a "
                    f"multiple of dp size {placement.dp_size} x accumulate_steps "
                    f"{accumulate_steps} = {multiple}"
                )
        return mapped(params, opt_state, batch)

    return step


def _placement(
    mesh: Mesh,
    axes: tuple[str, ...],
    axis_name: AxisName,
    batch_spec: P | None,
    param_specs: Any,
) -> _Placement:
    if batch_spec is None:
        batch_spec = P(display_axis(axes))
    elif not isinstance(batch_spec, P) or not batch_spec or spec_entry_axes(batch_spec[0]) != axes:
        raise ValueError(
            f"batch_spec must be a PartitionSpec whose first entry is the data-parallel axis "
            f"{axis_name!r} (the batch dimension), e.g. P({axis_name!r}, 'cp'); got {batch_spec!r}"
        )
    dp_size = 1
    for a in axes:
        dp_size *= mesh.shape[a]
    return _Placement(
        axes=axes,
        dp_size=dp_size,
        batch_spec=batch_spec,
        token_axes=tuple(a for entry in batch_spec[1:] for a in spec_entry_axes(entry)),
        param_specs=P() if param_specs is None else param_specs,
    )


def _check_sharded_optimizer(
    tx: ShardedOptimizer, mesh: Mesh, axes: tuple[str, ...], reduce: str, reduces_itself: bool
) -> None:
    settings = tx.settings
    if reduces_itself or reduce != settings.reduce or axes != settings.axes or mesh != tx.mesh:
        raise ValueError(
            "tx is a shard_optimizer(...), which reduces the local gradients itself: give "
            "data_parallel_step the same mesh, axis_name and reduce as shard_optimizer, and "
            "no plan, reduce_dtype, shared or param_specs"
        )


def _mapped_step(
    local_step: StepFn,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    placement: _Placement,
    *,
    derive_state_specs: bool,
) -> StepFn:
    """``local_step`` in one ``shard_map`` over ``mesh``, jitted."""
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    specs = placement.param_specs

    @jax.jit
    def mapped(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        if isinstance(tx, ShardedOptimizer):
            state_specs = tx.state_specs(params)
        elif derive_state_specs:
            state_specs = _state_specs(tx, opt_state, specs)
        else:
            state_specs = P()
        if explicit:  # Explicit axes: shard_map inputs must already carry its in_specs
            to_sharding = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
            params = jax.reshard(params, jax.tree.map(to_sharding, specs))
            opt_state = jax.reshard(opt_state, jax.tree.map(to_sharding, state_specs))
            batch = jax.reshard(batch, NamedSharding(mesh, placement.batch_spec))
        return jax.shard_map(
            local_step,
            mesh=mesh,
            in_specs=(specs, state_specs, placement.batch_spec),
            out_specs=(specs, state_specs, P()),
        )(params, opt_state, batch)

    return mapped


def _check_topology(shared: ReductionPlan, mesh: Mesh) -> None:
    topology = shared.topology
    expert_mesh = "edp" in mesh.axis_names
    if expert_mesh:
        sizes = dict(zip(topology.expert_mesh_axis_names, topology.expert_mesh_shape, strict=True))
    else:  # the dense generator's sizes: ep is 1 there once experts are carved out of dp
        sizes = dict(zip(topology.mesh_axis_names, topology.mesh_shape, strict=True))
    if any(mesh.shape.get(a, 1) != n for a, n in sizes.items()):
        raise ValueError(
            f"the shared reduction plan was made for axes {sizes} but the mesh has "
            f"{dict(mesh.shape)}; plan it with the mesh's topology "
            "(mesh_from_topology(topology) and plan_shared_reductions(..., topology))"
        )
    for group in shared.group_names:
        if topology.is_expert_group(group) != expert_mesh:
            need = "the expert mesh" if topology.is_expert_group(group) else "the dense mesh"
            raise ValueError(
                f"the shared reduction plan sums over group {group!r}, which lives on {need}, "
                f"but the mesh has axes {mesh.axis_names}; build the mesh with "
                f"mesh_from_topology(topology, expert={not expert_mesh}) (one shard_map runs "
                "over one of Megatron-core's two layouts: an MoE model with cp = 1 and etp = tp "
                "trains on the expert mesh)"
            )


def _expert_names(shared: ReductionPlan | None) -> frozenset[str]:
    if shared is None or "edp" not in shared.group_names:
        return frozenset()
    return frozenset(shared.reduction("edp").names)


def _check_expert_step(shared: ReductionPlan, placement: _Placement, reduce: str) -> None:
    divisor = shared.reduction("edp").divisor
    if reduce != "mean" or placement.dp_size != divisor:
        raise ValueError(
            f"expert gradients are summed over edp and divided by the dense dp "
            f"({divisor}), which equals the global mean only beside a dense mean over dp; "
            f"got reduce={reduce!r} over axes {placement.axes} of size {placement.dp_size}: "
            "pass reduce='mean' and the expert mesh's edp and ep axes as axis_name"
        )


def _sync_dense_then_shared(
    grads: Any,
    axis_name: AxisName,
    reduce: str,
    reduce_dtype: Any,
    plan: BucketPlan | None,
    shared: ReductionPlan,
    experts: frozenset[str],
) -> Any:
    """The dense leaves' data-parallel mean, then every planned sum (experts over edp).

    Experts are held by different devices along ``ep``, so a mean over the dense dp (which
    spans ``ep``) would mix different experts; ``plan``, if given, covers the dense leaves.
    """
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    names = leaf_names(grads)
    dense = [i for i, name in enumerate(names) if name not in experts]
    synced = sync_gradients(
        [leaves[i] for i in dense],
        axis_name,
        reduce=reduce,
        reduce_dtype=reduce_dtype,
        plan=plan,
        names=[names[i] for i in dense],
    )
    out = list(leaves)
    for i, value in zip(dense, synced, strict=True):
        out[i] = value
    return reduce_shared_gradients(jax.tree_util.tree_unflatten(treedef, out), shared, names=names)


def _state_specs(tx: optax.GradientTransformation, opt_state: Any, param_specs: Any) -> Any:
    """The optimizer state's specs: each parameter-shaped subtree gets ``param_specs``."""
    try:
        return optax.tree_map_params(
            tx, lambda _, spec: spec, opt_state, param_specs, transform_non_params=lambda _: P()
        )
    except Exception as err:  # optax raises whatever the init or the tree map raised
        raise ValueError(
            f"could not derive the optimizer state's PartitionSpecs from param_specs with "
            f"optax.tree_map_params ({type(err).__name__}: {err}); param_specs must match the "
            "params tree, and the optimizer's init must accept optax's params placeholder"
        ) from err
