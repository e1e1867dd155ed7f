"""A sharded Optax transformation: each device keeps 1/N of the optimizer state (ZeRO).

``shard_optimizer(inner, mesh)`` wraps any Optax transformation (ZeRO stage 1/2,
arXiv:1910.02054). ``init`` runs outside ``jax.shard_map`` and places the state already
sharded; ``update`` runs inside it on LOCAL gradients (docs/design.md §7), reduces them itself
(reduce-scatter), runs the inner update on this device's share only and all-gathers full,
replicated updates, so ``TrainState.apply_gradients`` and ``nnx.Optimizer`` work unchanged.
The partitions live in ``_zero_greedy`` (whole tensors) and ``_zero_flat`` (element ranges).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import DEFAULT_CAP_BYTES, ShardPlan
from gradsync_jax._sync import AxisName, _axes, _tracks_variance, _varying
from gradsync_jax._zero_clip import CROSS_PARAMETER, find_cross_parameter
from gradsync_jax._zero_flat import FlatLayout, build_flat, check_elementwise
from gradsync_jax._zero_greedy import GreedyLayout, build_greedy
from gradsync_jax._zero_space import abstract, model_space, pure, signature

PARTITIONS = ("greedy", "flat")


class ZeroState(NamedTuple):
    """State of ``shard_optimizer``.

    Attributes:
        inner: the inner transformation's own state type (so ``state.inner.hyperparams`` of
            ``inject_hyperparams`` works). ``partition="flat"``: its per-element leaves
            (``mu``, ``nu``, ...) are 1-D, one per gradient bucket, sharded over the axis.
            ``partition="greedy"``: only the leaves tied to no parameter (``count``, hyper-
            parameters), replicated; the per-parameter positions are ``None``.
        shards: ``partition="greedy"``: per dtype a ``(N, L)`` buffer sharded over the axis,
            row ``d`` = device ``d``'s per-parameter state, packed. Empty for ``"flat"``.
    """

    inner: Any
    shards: dict[str, jax.Array]


Layout = GreedyLayout | FlatLayout


class _Config:
    """What ``init``/``update`` close over: the settings and the cached layouts."""

    def __init__(
        self,
        inner: Any,
        mesh: Mesh,
        axis_name: AxisName,
        partition: str,
        reduce: str,
        bucket_cap_bytes: int,
    ) -> None:
        self.inner = optax.with_extra_args_support(inner)
        self.mesh = mesh
        self.axis_name = axis_name
        self.axes = _axes(axis_name)
        self.spec_entry = self.axes[0] if len(self.axes) == 1 else self.axes
        self.world_size = math.prod(mesh.shape[a] for a in self.axes)
        self.partition = partition
        self.reduce = reduce
        self.bucket_cap_bytes = bucket_cap_bytes
        self.layouts: dict[Any, Layout] = {}
        self.bodies: dict[int, Any] = {}  # id(layout) -> jitted update body (layouts are kept)

    def layout(self, params: Any) -> Layout:
        params = abstract(pure(params))
        key = signature(params)
        if key not in self.layouts:
            space = model_space(self.inner, params)
            if self.partition == "greedy":
                layout: Layout = build_greedy(
                    self.inner, space, params, self.world_size, self.bucket_cap_bytes
                )
            else:
                layout = build_flat(self.inner, space, self.world_size, self.bucket_cap_bytes)
            self.layouts[key] = layout
        return self.layouts[key]

    def body(self, layout: Layout) -> Any:
        """The update after the checks: local gradients in, full updates and new state out."""

        def run(grads: list[Any], inner: Any, shards: Any, params: Any, extra: Any) -> Any:
            return layout.update_local(
                self.inner, grads, inner, shards, params, extra, self.axes, self.reduce == "mean"
            )

        return run

    def jitted(self, layout: Layout) -> Any:
        if id(layout) not in self.bodies:
            self.bodies[id(layout)] = jax.jit(self.body(layout))
        return self.bodies[id(layout)]

    def specs(self, layout: Layout) -> ZeroState:
        inner, shards = layout.state_specs(self.spec_entry)
        return ZeroState(inner=inner, shards=shards)


class ShardedOptimizer(optax.GradientTransformationExtraArgs):
    """What ``shard_optimizer`` returns: an Optax transformation plus layout helpers.

    The helpers take the parameter tree (arrays or ``ShapeDtypeStruct``) because the layout
    is planned from it; each plan is computed once per tree signature and cached.
    """

    config: _Config

    @property
    def mesh(self) -> Mesh:
        return self.config.mesh

    @property
    def axis_name(self) -> AxisName:
        return self.config.axis_name

    @property
    def partition(self) -> str:
        return self.config.partition

    @property
    def world_size(self) -> int:
        """Devices sharing the state (the size of ``axis_name``)."""
        return self.config.world_size

    def plan(self, params: Any) -> ShardPlan:
        """The ``gradsync_core.ShardPlan`` in force (owners, padding, imbalance)."""
        return self.config.layout(params).plan

    def state_specs(self, params: Any) -> ZeroState:
        """The ``PartitionSpec`` of every state leaf: use as ``shard_map`` in/out specs."""
        return self.config.specs(self.config.layout(params))

    def state_shardings(self, params: Any) -> ZeroState:
        """``state_specs`` as ``NamedSharding`` on the mesh: for ``device_put``/checkpointing."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.state_specs(params),
            is_leaf=lambda x: isinstance(x, P),
        )

    def state_nbytes_per_device(self, params: Any) -> int:
        """Planned optimizer-state bytes on each device (padding included)."""
        return self.config.layout(params).nbytes_per_device()

    def gather_state(self, state: ZeroState, params: Any) -> Any:
        """The state as the unsharded inner optimizer holds it (NumPy leaves, host memory).

        Example:
            >>> np.testing.assert_allclose(tx.gather_state(s, p)[0].mu["w"], ref[0].mu["w"])
        """
        layout = self.config.layout(params)
        values = layout.gather(state.inner, dict(state.shards))
        return layout.space.state_treedef.unflatten(values)

    def scatter_state(self, inner_state: Any, params: Any) -> ZeroState:
        """Shard an unsharded inner state (as ``inner.init`` makes it) onto the mesh.

        Raises:
            ValueError: if its leaves' shapes do not match ``inner.init(params)``'s.
        """
        layout = self.config.layout(params)
        leaves = layout.space.state_treedef.flatten_up_to(inner_state)
        for leaf, value in zip(layout.space.leaves, leaves, strict=True):
            if tuple(np.shape(value)) != leaf.shape:
                raise ValueError(
                    f"state leaf {leaf.name!r} has shape {np.shape(value)}, expected {leaf.shape}"
                )
        values = [
            np.asarray(v, dtype=s.dtype) for s, v in zip(layout.space.leaves, leaves, strict=True)
        ]
        inner, shards = layout.scatter(values)
        return jax.device_put(ZeroState(inner=inner, shards=shards), self.state_shardings(params))


def _explicit(mesh: Mesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def _make_init(config: _Config) -> Any:
    axes = config.axes
    jitted: dict[int, Any] = {}

    def build(layout: Layout) -> Any:
        specs = config.specs(layout)
        replicated = NamedSharding(config.mesh, P())
        if isinstance(layout, GreedyLayout):
            in_spec = P()
            prepare = lambda leaves: leaves  # noqa: E731
        else:
            in_spec = P(config.spec_entry)
            prepare = layout._flat

        def local(leaves: list[Any]) -> ZeroState:
            inner, shards = layout.init_local(config.inner, leaves, axes)
            return ZeroState(inner=inner, shards=shards)

        mapped = jax.shard_map(local, mesh=config.mesh, in_specs=(in_spec,), out_specs=specs)

        def run(leaves: list[Any]) -> ZeroState:
            if _explicit(config.mesh):  # Explicit axes: shard_map inputs must carry its in_specs
                leaves = jax.reshard(leaves, replicated)
            inputs = prepare(leaves)
            if _explicit(config.mesh):
                inputs = jax.reshard(inputs, NamedSharding(config.mesh, in_spec))
            return mapped(inputs)

        return jax.jit(run)

    def init(params: Any) -> ZeroState:
        params = pure(params)
        layout = config.layout(params)
        if id(layout) not in jitted:
            jitted[id(layout)] = build(layout)
        leaves = layout.space.param_treedef.flatten_up_to(params)
        leaves = jax.device_put(leaves, NamedSharding(config.mesh, P()))
        return jitted[id(layout)](leaves)

    return init


def _check_inside(axes: tuple[str, ...], n: int) -> bool:
    try:
        size = lax.axis_size(axes)
    except NameError:
        raise ValueError(
            f"the update of shard_optimizer must run inside jax.shard_map over mesh axis "
            f"{axes[0] if len(axes) == 1 else axes!r}, with the optimizer state passed with "
            "in_specs=tx.state_specs(params) (it reduces the local gradients itself)"
        ) from None
    if size != n:
        raise ValueError(
            f"axis {axes} has {size} devices here but the optimizer was built for {n}; "
            "build shard_optimizer with the mesh the step runs on"
        )
    return _tracks_variance(axes)


def _make_update(config: _Config) -> Any:
    axes = config.axes

    def update(
        updates: Any, state: ZeroState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ZeroState]:
        tracked = _check_inside(axes, config.world_size)
        updates, params = pure(updates), pure(params)
        layout = config.layout(updates)
        treedef = layout.space.param_treedef
        grads = treedef.flatten_up_to(updates)
        for spec, g in zip(layout.space.specs, grads, strict=True):
            if not jnp.issubdtype(g.dtype, jnp.inexact):
                raise TypeError(f"gradient {spec.name!r} has non-floating dtype {g.dtype}")
            if tracked and not set(axes) <= _varying(g):
                raise ValueError(
                    f"gradient {spec.name!r} is invariant over {config.axis_name!r}: it was "
                    "already summed (jax.grad of a replicated parameter inside shard_map, or "
                    "sync_gradients), and shard_optimizer would sum it again. Pass LOCAL "
                    "gradients: differentiate w.r.t. gradsync_jax.make_local(params) (or use "
                    "value_and_local_grad) and do not call sync_gradients first"
                )
        if not isinstance(state, ZeroState):
            raise TypeError(
                f"state must be the ZeroState from this transformation's init, got "
                f"{type(state).__name__}"
            )
        inner_specs, expected = layout.state_specs(config.spec_entry)
        wanted = len(jax.tree.leaves(inner_specs, is_leaf=lambda x: isinstance(x, P)))
        if len(jax.tree.leaves(state.inner)) != wanted or set(state.shards) != set(expected):
            raise ValueError(
                "the optimizer state does not match this transformation and parameter tree: "
                "pass the state that tx.init(params) returned (and the updates made from it)"
            )
        for dtype, buf in state.shards.items():
            if dtype not in expected or buf.ndim != 2 or buf.shape[0] != 1:
                raise ValueError(
                    f"optimizer state buffer {dtype!r} has local shape {buf.shape}; pass the "
                    "state into shard_map with in_specs=tx.state_specs(params) (one row per "
                    "device) and the same parameter tree it was initialized with"
                )
        p_leaves = None if params is None else treedef.flatten_up_to(params)
        arrays = (jax.Array, np.ndarray, np.generic, float, int)
        if all(isinstance(x, arrays) for x in jax.tree.leaves(extra_args)):
            # One jitted body: inlined under the user's jit, and compiled once (not primitive
            # by primitive, every step) when the step runs in shard_map without jit.
            leaves, new_inner, new_shards = config.jitted(layout)(
                grads, state.inner, dict(state.shards), p_leaves, extra_args
            )
        else:  # e.g. a value_fn for a line search: not a jit argument
            leaves, new_inner, new_shards = config.body(layout)(
                grads, state.inner, dict(state.shards), p_leaves, extra_args
            )
        return treedef.unflatten(leaves), ZeroState(inner=new_inner, shards=new_shards)

    return update


def shard_optimizer(
    inner: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: AxisName = "dp",
    partition: str = "greedy",
    reduce: str = "mean",
    bucket_cap_bytes: int = DEFAULT_CAP_BYTES,
) -> ShardedOptimizer:
    """Wrap ``inner`` so each device along ``axis_name`` keeps 1/N of its state (ZeRO).

    ``init(params)`` runs outside ``shard_map`` (also under ``jax.eval_shape``) and returns a
    ``ZeroState`` already placed with ``state_shardings(params)``. ``update(grads, state,
    params)`` runs inside ``jax.shard_map`` with ``in_specs=tx.state_specs(params)`` for the
    state; ``grads`` are LOCAL (docs/design.md §7: ``make_local`` / ``value_and_local_grad``), and it
    returns the FULL update, identical on every device, plus the new sharded state.

    Args:
        inner: any Optax transformation (``optax.chain``, schedules, ``inject_hyperparams``
            work). For global-norm clipping put ``gradsync_jax.clip_by_global_norm`` first
            in it.
        mesh: the mesh the training step's ``shard_map`` runs on.
        axis_name: the data-parallel axis (or tuple of axes) the batch is split over.
        partition: ``"greedy"``: whole parameters per device (``plan_greedy_shards``, the
            owners torch's ZeRO optimizer picks), any optimizer. ``"flat"``: element ranges of
            gradient buckets, one reduce-scatter and one all-gather per bucket, elementwise
            optimizers only (checked when built).
        reduce: ``"mean"`` divides the local gradients by N before the sum; ``"sum"`` does not.
        bucket_cap_bytes: ``"flat"``: the gradient bucket size; ``"greedy"``: the size of
            the column chunks its packed gradients are reduce-scattered in.

    Returns:
        A ``ShardedOptimizer`` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
        ValueError: on an unknown partition/reduce, an axis the mesh lacks, a cross-parameter
            transformation inside ``inner`` (``optax.clip_by_global_norm``), or (``"flat"``)
            a non-elementwise ``inner``.

    Example:
        >>> tx = shard_optimizer(optax.adam(1e-3), mesh)
        >>> opt_state = tx.init(params)
        >>> @jax.jit
        ... @partial(jax.shard_map, mesh=mesh, in_specs=(P(), tx.state_specs(params), P("dp")),
        ...          out_specs=(P(), tx.state_specs(params)))
        ... def step(params, opt_state, batch):
        ...     grads = local_grad(loss_fn)(params, batch)
        ...     updates, opt_state = tx.update(grads, opt_state, params)
        ...     return optax.apply_updates(params, updates), opt_state
    """
    if partition not in PARTITIONS:
        raise ValueError(f"partition must be one of {PARTITIONS}, got {partition!r}")
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    axes = _axes(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis {missing[0]!r} is not an axis of the mesh {mesh.axis_names}")
    found = find_cross_parameter(inner)
    if found:
        raise ValueError(
            f"inner contains optax.{found}, which combines all parameters' gradients; "
            f"shard_optimizer runs it on each device's share only, which silently changes "
            f"its result: {CROSS_PARAMETER[found]}"
        )
    if partition == "flat":
        check_elementwise(inner)
    config = _Config(inner, mesh, axis_name, partition, reduce, bucket_cap_bytes)
    tx = ShardedOptimizer(_make_init(config), _make_update(config))
    tx.config = config  # a NamedTuple subclass without __slots__ keeps a __dict__
    return tx
