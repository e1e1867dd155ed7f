"""``data_parallel_step``: a jitted training step, batch sharded over ``dp``.

Parameters replicated (or sharded over model-parallel axes, with the derived shared-parameter
sums, docs/design.md §6).

The step composes like Optax: it differentiates, and the transformation ``tx`` it is given
owns the sync, either ``synced(...)`` first in a chain or a ``shard_optimizer(...)``, which
reduce-scatters itself. A ``tx`` with neither (a plain ``optax.adam(...)``) gets the default
``synced(axis_name)`` in front, so a plain optimizer still trains on the global mean; two
syncs are refused (the mean of a mean is the mean, but a second ``psum`` of an invariant
gradient is refused by the sync, and a second bucketed pass only costs time).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_jax._axes import AxisName, axis_tuple, display_axis, spec_entry_axes
from gradsync_jax._compile_log import CompileLog
from gradsync_jax.data_parallel.accumulate import accumulate_local_grads
from gradsync_jax.data_parallel.synced import SyncedState
from gradsync_jax.shared_reductions import check_plan_mesh, make_shared_local
from gradsync_jax.zero.layout import ZeroState
from gradsync_jax.zero.transform import ShardedOptimizer

StepFn = Callable[[Any, Any, Any], tuple[Any, Any, jax.Array]]
_LOG = logging.getLogger(__name__)


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
    accumulate_steps: int = 1,
    param_specs: Any = None,
    batch_spec: P | None = None,
    loss_as: str | None = None,
) -> StepFn:
    """Build ``step(params, opt_state, batch) -> (params, opt_state, loss)``, jitted.

    Inside one ``jax.shard_map`` over ``mesh``: each device computes LOCAL gradients of its
    batch shard (``accumulate_steps`` micro-steps without communication) and ``tx`` runs on
    them; its sync reduces them once over ``axis_name`` (docs/design.md §7: no implicit
    ``psum``, no double count), so the update is identical on every device. The user never
    sees ``pcast``.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean over its (local) batch.
        tx: the Optax transformation, ``opt_state = tx.init(params)``, holding the sync:
            ``optax.chain(synced(axis_name, reduce=..., reduce_dtype=..., plan=...,
            shared=...), optax.adam(1e-3))``, or a ``shard_optimizer(...)`` (ZeRO: it
            reduce-scatters the local gradients itself; its state carries
            ``tx.state_specs(params)``). A ``tx`` without either is run after the default
            ``synced(axis_name)``, the mean over ``axis_name``. With a ``synced(...,
            shared=plan)`` (model parallelism: ``plan_shared_reductions(shared_param_specs(
            params, param_specs, data_axes=batch_spec, mesh=mesh), topology)``) the planned
            gradients stay partial through accumulation and are summed over their groups
            once, bucketed, after the dp mean; expert parameters (the plan's ``"edp"``
            reduction) need the expert mesh (``mesh_from_topology(topology, expert=True)``)
            with the batch on ``axis_name=("edp", "ep")``.
        mesh: e.g. ``mesh_from_topology(Topology.create(len(jax.devices())))``.
        axis_name: the mesh axis (or tuple of axes) the batch is sharded over; a
            ``synced`` in ``tx`` must name the same.
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
        loss_as: pass the global mean loss to ``tx.update`` as this keyword argument of an
            ``optax.GradientTransformationExtraArgs``: ``"value"`` for ``optax.polyak_sgd``
            and ``optax.contrib.reduce_on_plateau``. Default: no extra argument.
    Returns:
        ``step``; ``batch`` is a pytree whose leaves share a leading dimension divisible by
        ``dp_size * accumulate_steps``; ``loss`` is the mean over the global batch.
        Parameters or state not yet on the mesh (host or one-device arrays, as
        ``model.init`` and ``tx.init`` make them) are placed as the step returns them, so
        a loop compiles once; each compilation logs at INFO (``logging``, silent by default).

    Raises:
        ValueError: if ``axis_name`` is not a mesh axis, ``batch_spec`` does not start with
            it, a ``shard_optimizer`` was built for another mesh or axis (or is given
            ``param_specs``), the optimizer state's specs cannot be derived from
            ``param_specs``, or (when called) ``tx`` syncs twice or over another axis, a
            ``shared`` plan was made for another topology, or the batch does not split evenly.

    Example:
        >>> mesh = mesh_from_topology(Topology.create(8))
        >>> tx = optax.chain(synced("dp"), optax.adam(1e-3))  # or just optax.adam(1e-3)
        >>> step = data_parallel_step(loss_fn, tx, mesh)
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
    if isinstance(tx, ShardedOptimizer):
        _check_sharded_optimizer(tx, mesh, axes, param_specs)
    parts = _Step(
        loss_fn=loss_fn,
        tx=tx,
        mesh=mesh,
        axis_name=axis_name,
        placement=_placement(mesh, axes, axis_name, batch_spec, param_specs),
        accumulate_steps=accumulate_steps,
        loss_as=loss_as,
        derive_state_specs=param_specs is not None,
        default_sync=SyncedState(axis_name=axis_name),
    )
    compile_log = CompileLog(_LOG, "data_parallel_step")
    mapped = _mapped_step(parts, compile_log)

    def step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        parts.check_batch(batch)
        if _unplaced((params, opt_state)):
            # jit compiles once per input sharding: host or one-device inputs (the first
            # step after model.init and tx.init) are placed as the step returns them, so
            # the first step and the rest share one compilation.
            params, opt_state = parts.place(params, opt_state)
        return compile_log.call(mapped, params, opt_state, batch)

    return step


def _unplaced(tree: Any) -> bool:
    """Whether a leaf of ``tree`` is not placed on a mesh (NumPy, one device)."""
    return any(
        not isinstance(getattr(x, "sharding", None), NamedSharding) for x in jax.tree.leaves(tree)
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _Step:
    """The pieces of one ``data_parallel_step``: the local step and its checks."""

    loss_fn: Callable[[Any, Any], jax.Array]
    tx: optax.GradientTransformation
    mesh: Mesh
    axis_name: AxisName
    placement: _Placement
    accumulate_steps: int
    loss_as: str | None
    derive_state_specs: bool
    default_sync: SyncedState

    def check_batch(self, batch: Any) -> None:
        multiple = self.placement.dp_size * self.accumulate_steps
        for leaf in jax.tree.leaves(batch):
            if leaf.ndim == 0 or leaf.shape[0] % multiple:
                raise ValueError(
                    f"a batch leaf has shape {leaf.shape}; its leading dimension must be a "
                    f"multiple of dp size {self.placement.dp_size} x accumulate_steps "
                    f"{self.accumulate_steps} = {multiple}"
                )

    def state_specs(self, params: Any, opt_state: Any) -> Any:
        """The optimizer state's ``PartitionSpec``s (a prefix of its tree)."""
        if isinstance(self.tx, ShardedOptimizer):
            return self.tx.state_specs(params)
        if self.derive_state_specs:
            return _state_specs(self.tx, opt_state, self.placement.param_specs)
        return P()

    def place(self, params: Any, opt_state: Any) -> tuple[Any, Any]:
        """``params`` and ``opt_state`` on the mesh with the shardings the step returns."""
        to_sharding = lambda spec: NamedSharding(self.mesh, spec)  # noqa: E731
        is_spec = lambda x: isinstance(x, P)  # noqa: E731
        param_shardings = jax.tree.map(to_sharding, self.placement.param_specs, is_leaf=is_spec)
        specs = self.state_specs(params, opt_state)
        state_shardings = jax.tree.map(to_sharding, specs, is_leaf=is_spec)
        return jax.device_put(params, param_shardings), jax.device_put(opt_state, state_shardings)

    def sync_of(self, opt_state: Any) -> _Sync:
        """The one sync ``tx`` holds (found in its state), or the default ``synced``."""
        is_sync = lambda x: isinstance(x, (SyncedState, ZeroState))  # noqa: E731
        found = [x for x in jax.tree.leaves(opt_state, is_leaf=is_sync) if is_sync(x)]
        if len(found) > 1:
            raise ValueError(
                f"tx syncs the gradients {len(found)} times (its state holds "
                f"{', '.join(type(x).__name__ for x in found)}); keep exactly one "
                "synced(...) or shard_optimizer(...), which reduces the local gradients itself"
            )
        if not found:  # a plain Optax transformation: the mean over the step's axis first
            return _Sync(state=self.default_sync, implicit=True)
        if isinstance(found[0], ZeroState):
            if not isinstance(self.tx, ShardedOptimizer):
                raise ValueError(
                    "tx holds a shard_optimizer(...) inside another transformation; pass the "
                    "shard_optimizer itself as tx (chain other transformations inside it)"
                )
            return _Sync(state=None, implicit=False)
        state = found[0]
        if state.axes != self.placement.axes:
            raise ValueError(
                f"tx holds synced({state.axis_name!r}) but the step's batch is sharded over "
                f"axis_name={self.axis_name!r}; give both the same axis"
            )
        if state.shared is not None:
            check_plan_mesh(state.shared, self.mesh)
        return _Sync(state=state, implicit=False)

    def local_step(self, sync: _Sync) -> StepFn:
        """The step of one device, inside ``shard_map``."""
        shared = None if sync.state is None else sync.state.shared
        tx, axis_name, token_axes = self.tx, self.axis_name, self.placement.token_axes
        # A plain GradientTransformation ignores the loss; an ExtraArgs one takes it by name.
        update = tx.update if self.loss_as is None else optax.with_extra_args_support(tx).update

        def local_step(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
            # Planned parameters vary over their groups, so their gradients stay partial
            # through the micro-steps and the sync sums them once.
            local = params if shared is None else make_shared_local(params, shared)
            loss, grads = accumulate_local_grads(
                self.loss_fn, local, batch, self.accumulate_steps, axis_name=axis_name
            )
            if sync.implicit:
                grads = sync.state.sync(grads)  # type: ignore[union-attr]
            if token_axes:  # each device holds its share of its replica's loss
                loss = lax.psum(loss, token_axes)
            loss = lax.pmean(loss, axis_name)  # the global mean: the same on every device
            extra_args = {} if self.loss_as is None else {self.loss_as: loss}
            updates, opt_state = update(grads, opt_state, params, **extra_args)
            return optax.apply_updates(params, updates), opt_state, loss

        return local_step


@dataclass(frozen=True, slots=True)
class _Sync:
    """The sync a step runs: ``tx``'s own ``synced`` (or none for a ``shard_optimizer``), or
    the default one the step applies before ``tx`` (``implicit``)."""

    state: SyncedState | None
    implicit: bool


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
    tx: ShardedOptimizer, mesh: Mesh, axes: tuple[str, ...], param_specs: Any
) -> None:
    if param_specs is not None or axes != tx.settings.axes or mesh != tx.mesh:
        raise ValueError(
            "tx is a shard_optimizer(...), which reduces the local gradients itself: give "
            "data_parallel_step the same mesh and axis_name as shard_optimizer, and no "
            "param_specs"
        )


def _mapped_step(parts: _Step, compile_log: CompileLog) -> StepFn:
    """The local step in one ``shard_map`` over the mesh, jitted. The sync is found in the
    optimizer state while tracing: jit traces once per state structure, so a call costs
    nothing beyond jit's own dispatch."""
    mesh, placement = parts.mesh, parts.placement
    explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
    specs = placement.param_specs

    @jax.jit
    def mapped(params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        compile_log.tracing(params)
        local_step = parts.local_step(parts.sync_of(opt_state))
        state_specs = parts.state_specs(params, opt_state)
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
