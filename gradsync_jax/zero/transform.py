"""A sharded Optax transformation: each device keeps 1/N of the optimizer state (ZeRO).

``shard_optimizer(inner, mesh)`` wraps any Optax transformation (ZeRO stage 1/2,
arXiv:1910.02054). ``init`` runs outside ``jax.shard_map`` and places the state already
sharded; ``update`` runs inside it on LOCAL gradients (docs/design.md §7), reduces them itself
(reduce-scatter), runs the inner update on this device's share only and all-gathers full,
replicated updates, so ``TrainState.apply_gradients`` and ``nnx.Optimizer`` work unchanged.
The partitions live in ``greedy`` (whole tensors) and ``flat`` (element ranges), behind the
``layout.Layout`` protocol.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import MIB, MatrixOwnerPlan, ShardPlan
from gradsync_jax._axes import AxisName, axis_tuple, display_axis
from gradsync_jax._compile_log import CompileLog
from gradsync_jax.zero.checks import check_grads, check_inside, check_state
from gradsync_jax.zero.clip import GLOBAL_NORM
from gradsync_jax.zero.flat import FlatLayout, not_elementwise
from gradsync_jax.zero.gathered import GatheredLayout, build_gathered
from gradsync_jax.zero.greedy import build_greedy
from gradsync_jax.zero.layout import Collective, Layout, UpdateInputs, UpdateResult, ZeroState
from gradsync_jax.zero.matrices import MUON_REASON, keeps_muon_state, matrix_owner_plan
from gradsync_jax.zero.model_space import abstract, model_space, pure, signature
from gradsync_jax.zero.soundness import (
    Soundness,
    analysed,
    check_on_sample,
    flat_layout,
    split_extra_args,
)

PARTITIONS = ("auto", "greedy", "flat", "gathered")
_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True, kw_only=True)
class ZeroSettings:
    """The arguments of ``shard_optimizer``, checked and normalised."""

    inner: optax.GradientTransformationExtraArgs
    # The transformation as given, before ``optax.with_extra_args_support`` wrapped it (a
    # new wrapper per call): what the analysis cache keys on (``soundness.analysed``).
    given: Any
    mesh: Mesh
    axis_name: AxisName
    partition: str
    reduce: str
    bucket_cap_bytes: int
    # torch registration order of the parameters (torch names, after ``modules`` renames):
    # ties between equal sizes go to the owners torch's ZeroRedundancyOptimizer picks.
    order: tuple[str, ...] | None = None
    modules: tuple[tuple[str, str], ...] | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return axis_tuple(self.axis_name)

    @property
    def spec_entry(self) -> str | tuple[str, ...]:
        """The ``PartitionSpec`` entry that shards over the axes."""
        return display_axis(self.axes)

    @property
    def world_size(self) -> int:
        return math.prod(self.mesh.shape[a] for a in self.axes)

    @property
    def collective(self) -> Collective:
        return Collective(axes=self.axes, mean=self.reduce == "mean")


class _LayoutCache:
    """Layouts planned once per parameter-tree signature, and their compiled bodies.

    Keyed by layout identity: a layout is kept as long as the cache, so ids stay unique.
    """

    def __init__(self, settings: ZeroSettings) -> None:
        self.settings = settings
        self._layouts: dict[Any, Layout] = {}
        self._inits: dict[int, Any] = {}
        self._updates: dict[int, Any] = {}
        self._verified: set[Any] = set()  # (layout id, params given, extra-argument keys)

    def layout(self, params: Any) -> Layout:
        params = abstract(pure(params))
        key = signature(params)
        if key not in self._layouts:
            self._layouts[key] = self._plan(params)
        return self._layouts[key]

    def _plan(self, params: Any) -> Layout:
        """The partition asked for. ``"auto"``: flat when proven elementwise, else greedy
        when proven exact per tensor, else gathered (exact for any optimizer). ``"greedy"``
        and ``"flat"`` refuse what the analysis cannot prove exact for them, unless it
        needs the update's extra arguments (then checked at the first trace)."""
        s = self.settings
        space = _model_space(s.inner, params)
        # Torch's registration order, when given: the owners (and flat's buckets) follow it.
        ordered: dict[str, Any] = {
            "order": s.order,
            "modules": None if s.modules is None else dict(s.modules),
        }
        if s.partition == "gathered":
            return build_gathered(space, s.world_size, **ordered)
        soundness, probe = _analyse(s, space, params)
        coupled = None if soundness is None else soundness.coupling()
        if coupled and s.partition != "auto":
            raise ValueError(coupled)
        if soundness is None or coupled:
            if s.partition == "auto":  # nothing proven: the partition that is always exact
                return build_gathered(space, s.world_size, **ordered)
        if s.partition in ("flat", "auto"):
            # auto: one bucket per parameter first. It packs nothing: each gradient is
            # reduce-scattered and each update all-gathered in place, where the torch-style
            # buckets copy every gradient into a bucket and every update out of one (measured
            # 2-4x faster on 8 CPU devices; docs/jax-zero.md, "Performance"). An explicit
            # "flat" keeps torch's buckets (ZeroRedundancyOptimizer's plan) where it can.
            flat, reason = flat_layout(
                soundness,
                s.inner,
                space,
                s.world_size,
                s.bucket_cap_bytes,
                by_param_first=s.partition == "auto",
                **ordered,
            )
            if flat is not None:
                if soundness is not None:
                    self._verified.add(self._check_key(flat, True, probe))
                return flat
            if s.partition == "flat":
                muon = keeps_muon_state(s.inner, params)
                raise not_elementwise(MUON_REASON if muon else reason)
        matrices = matrix_owner_plan(
            s.inner, space, params, s.world_size, modules=ordered["modules"]
        )
        try:
            greedy = build_greedy(
                s.inner,
                space,
                params,
                s.world_size,
                s.bucket_cap_bytes,
                matrix_owners=None if matrices is None else matrices[1],
                **ordered,
            )
        except ValueError:  # an init that cannot skip None leaves (galore)
            if s.partition != "auto":
                raise
            return build_gathered(space, s.world_size, **ordered)
        if soundness is not None:
            if problem := soundness.greedy_problem(greedy):
                if s.partition == "auto":
                    return build_gathered(space, s.world_size, **ordered)
                raise ValueError(problem)
            self._verified.add(self._check_key(greedy, True, probe))
        return greedy

    def _check_key(self, layout: Layout, with_params: bool, extra_args: dict[str, Any]) -> Any:
        arrays, others = split_extra_args(extra_args)
        return (id(layout), with_params, signature(arrays), tuple(sorted(others)))

    def verify(self, layout: Layout, with_params: bool, extra_args: dict[str, Any]) -> None:
        """Refuse, at the first trace, an update the analysis cannot prove exact for this
        layout with these extra arguments (``value=``, a ``value_fn``). The gathered
        partition runs the whole tree: nothing to prove."""
        key = self._check_key(layout, with_params, extra_args)
        if key in self._verified or isinstance(layout, GatheredLayout):
            return
        space = layout.space
        params = space.param_treedef.unflatten(
            [jax.ShapeDtypeStruct(p.shape, p.dtype) for p in space.specs]
        )
        soundness = Soundness(
            self.settings.inner, space, params, extra_args, with_params=with_params
        )
        if problem := soundness.coupling():
            raise ValueError(problem)
        if isinstance(layout, FlatLayout):
            if reason := soundness.flat_problem(layout):
                raise not_elementwise(reason)
        elif problem := soundness.greedy_problem(layout):  # type: ignore[arg-type]
            raise ValueError(problem)
        self._verified.add(key)

    def update_body(self, layout: Layout, *, jitted: bool) -> Any:
        """Local gradients in, full updates and new state out (inside ``shard_map``).

        Jitted, it is inlined under the user's jit and compiled once (not primitive by
        primitive, every step) when the step runs in ``shard_map`` without jit.
        """

        def body(inputs: UpdateInputs) -> UpdateResult:
            return layout.update_local(self.settings.inner, inputs, self.settings.collective)

        if not jitted:
            return body
        if id(layout) not in self._updates:
            self._updates[id(layout)] = jax.jit(body)
        return self._updates[id(layout)]

    def init_body(self, layout: Layout) -> Any:
        """Parameter leaves (replicated) in, the sharded ``ZeroState`` out; jitted."""
        if id(layout) not in self._inits:
            self._inits[id(layout)] = _build_init(self.settings, layout)
        return self._inits[id(layout)]


def _model_space(inner: optax.GradientTransformation, params: Any) -> Any:
    """``model_space``, or one sentence where ``inner``'s init cannot run on a tree without
    parameters (``optax.lbfgs``'s line search reads a parameter's dtype), which is how the
    global state leaves (count, hyper-parameters) are told from the per-parameter ones.

    Raises:
        ValueError: naming the failure and the way that needs no state mapping.
    """
    try:
        return model_space(inner, params)
    except ValueError:
        raise
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise ValueError(
            "shard_optimizer cannot map the inner transformation's state onto the parameters: "
            f"its init fails on a tree without parameters ({type(err).__name__}: {first}); "
            "keep this optimizer unsharded (data_parallel_step(loss_fn, tx, mesh))"
        ) from err


# An extra argument Optax optimizers commonly need before they can be traced (polyak_sgd's
# loss): tried at planning time so such an optimizer is analysed before init, not refused.
_VALUE_PROBE = {"value": jax.ShapeDtypeStruct((), np.float32)}


def _analyse(
    settings: ZeroSettings, space: Any, params: Any
) -> tuple[Soundness | None, dict[str, Any]]:
    """The whole-tree analysis without extra arguments, else with ``value=``; ``None`` if
    the update cannot be traced either way (it needs a ``value_fn``, or it raises: e.g.
    ``gradsync_jax.clip_by_global_norm`` behind another transformation). Cached per
    optimizer and tree: planning each partition, or again, does not trace it again."""
    for probe in ({}, _VALUE_PROBE):
        soundness = analysed(settings.given, settings.inner, space, params, probe)
        if soundness is not None:  # else analysed at the first update instead
            return soundness, probe
    return None, {}


def _explicit(mesh: Mesh) -> bool:
    return all(t == AxisType.Explicit for t in mesh.axis_types)


def _build_init(settings: ZeroSettings, layout: Layout) -> Any:
    """The jitted init of ``layout`` (parameter leaves in, the sharded state out), logged."""
    mesh = settings.mesh
    compile_log = CompileLog(_LOG, "shard_optimizer's init")
    in_spec = P(settings.spec_entry) if layout.init_sharded() else P()

    def local(inputs: list[Any]) -> ZeroState:
        return layout.init_local(settings.inner, inputs, settings.axes)

    specs = layout.state_specs(settings.spec_entry)
    mapped = jax.shard_map(local, mesh=mesh, in_specs=(in_spec,), out_specs=specs)

    def run(leaves: list[Any]) -> ZeroState:
        compile_log.tracing(leaves)
        if _explicit(mesh):  # Explicit axes: shard_map inputs must carry its in_specs
            leaves = jax.reshard(leaves, NamedSharding(mesh, P()))
        inputs = layout.init_inputs(leaves)
        if _explicit(mesh):
            inputs = jax.reshard(inputs, NamedSharding(mesh, in_spec))
        return mapped(inputs)

    jitted = jax.jit(run)
    return lambda leaves: compile_log.call(jitted, leaves)


class _ZeroTransform:
    """The ``init`` and ``update`` of one ``shard_optimizer``, over its settings and cache."""

    def __init__(self, settings: ZeroSettings) -> None:
        self.settings = settings
        self.cache = _LayoutCache(settings)

    def init(self, params: Any) -> ZeroState:
        params = pure(params)
        layout = self.cache.layout(params)
        leaves = layout.space.param_treedef.flatten_up_to(params)
        leaves = jax.device_put(leaves, NamedSharding(self.settings.mesh, P()))
        return self.cache.init_body(layout)(leaves)

    def update(
        self, updates: Any, state: ZeroState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, ZeroState]:
        settings = self.settings
        if GLOBAL_NORM in extra_args:
            raise ValueError(
                f"{GLOBAL_NORM}= is the extra argument shard_optimizer passes its inner "
                "update (the gradient norm across devices); pass yours under another name"
            )
        tracked = check_inside(settings.axes, settings.world_size)
        updates, params = pure(updates), pure(params)
        layout = self.cache.layout(updates)
        treedef = layout.space.param_treedef
        grads = treedef.flatten_up_to(updates)
        check_grads(settings.axis_name, layout, grads, tracked)
        check_state(settings.spec_entry, layout, state)
        self.cache.verify(layout, params is not None, extra_args)
        inputs = UpdateInputs(
            grads=grads,
            state=ZeroState(inner=state.inner, shards=dict(state.shards)),
            params=None if params is None else treedef.flatten_up_to(params),
            extra_args=extra_args,
        )
        arrays = (jax.Array, np.ndarray, np.generic, float, int)
        # A non-array extra argument (a line search's value_fn) cannot be a jit argument.
        jitted = all(isinstance(x, arrays) for x in jax.tree.leaves(extra_args))
        result = self.cache.update_body(layout, jitted=jitted)(inputs)
        return treedef.unflatten(result.updates), result.state


class ShardedOptimizer(optax.GradientTransformationExtraArgs):
    """What ``shard_optimizer`` returns: an Optax transformation plus layout helpers.

    ``init`` and ``update`` are the methods of one private transform object that owns the
    settings and the layout cache; the tuple stays what Optax expects (two functions) and
    keeps that object as an explicit handle beside them (``_transform``, set at
    construction). The helpers take the parameter tree (arrays or ``ShapeDtypeStruct``)
    because the layout is planned from it; each plan is computed once per tree signature
    and cached.
    """

    _transform: _ZeroTransform

    def __new__(cls, transform: _ZeroTransform) -> ShardedOptimizer:
        self = super().__new__(cls, transform.init, transform.update)
        self._transform = transform
        return self

    def __getnewargs__(self) -> tuple[_ZeroTransform]:  # copy/pickle rebuild from the handle
        return (self._transform,)

    @property
    def settings(self) -> ZeroSettings:
        """The checked arguments of ``shard_optimizer`` (read-only)."""
        return self._transform.settings

    @property
    def mesh(self) -> Mesh:
        return self.settings.mesh

    @property
    def axis_name(self) -> AxisName:
        return self.settings.axis_name

    @property
    def partition(self) -> str:
        return self.settings.partition

    @property
    def world_size(self) -> int:
        """Devices sharing the state (the size of ``axis_name``)."""
        return self.settings.world_size

    def layout(self, params: Any) -> Layout:
        """The partition's ``Layout`` for ``params`` (where every state leaf is stored)."""
        return self._transform.cache.layout(params)

    def plan(self, params: Any) -> ShardPlan:
        """The ``gradsync_core.ShardPlan`` in force (owners, padding, imbalance)."""
        return self.layout(params).plan

    def matrix_plan(self, params: Any) -> MatrixOwnerPlan | None:
        """The matrix-owner plan of a Muon's matrices (torch names; the plan torch's
        ``MatrixOptimizer`` makes for the twin model), or ``None`` for another optimizer.
        The greedy partition steps each matrix on this plan's owner."""
        params = abstract(pure(params))
        s = self.settings
        space = _model_space(s.inner, params)
        modules = None if s.modules is None else dict(s.modules)
        found = matrix_owner_plan(s.inner, space, params, s.world_size, modules=modules)
        return None if found is None else found[0]

    def state_specs(self, params: Any) -> ZeroState:
        """The ``PartitionSpec`` of every state leaf: use as ``shard_map`` in/out specs."""
        return self.layout(params).state_specs(self.settings.spec_entry)

    def state_shardings(self, params: Any) -> ZeroState:
        """``state_specs`` as ``NamedSharding`` on the mesh: for ``device_put``/checkpointing."""
        return jax.tree.map(
            lambda spec: NamedSharding(self.mesh, spec),
            self.state_specs(params),
            is_leaf=lambda x: isinstance(x, P),
        )

    def state_nbytes_per_device(self, params: Any) -> int:
        """Planned optimizer-state bytes on each device (padding included)."""
        return self.layout(params).nbytes_per_device()

    def gather_state(self, state: ZeroState, params: Any) -> Any:
        """The state as the unsharded inner optimizer holds it (NumPy leaves, host memory).

        Example:
            >>> np.testing.assert_allclose(tx.gather_state(s, p)[0].mu["w"], ref[0].mu["w"])
        """
        layout = self.layout(params)
        values = layout.gather(ZeroState(inner=state.inner, shards=dict(state.shards)))
        return layout.space.state_treedef.unflatten(values)

    def scatter_state(self, inner_state: Any, params: Any) -> ZeroState:
        """Shard an unsharded inner state (as ``inner.init`` makes it) onto the mesh.

        Raises:
            ValueError: if its leaves' shapes do not match ``inner.init(params)``'s.
        """
        layout = self.layout(params)
        leaves = layout.space.state_treedef.flatten_up_to(inner_state)
        for leaf, value in zip(layout.space.leaves, leaves, strict=True):
            if tuple(np.shape(value)) != leaf.shape:
                raise ValueError(
                    f"state leaf {leaf.name!r} has shape {np.shape(value)}, expected {leaf.shape}"
                )
        values = [
            np.asarray(v, dtype=s.dtype) for s, v in zip(layout.space.leaves, leaves, strict=True)
        ]
        return jax.device_put(layout.scatter(values), self.state_shardings(params))


def shard_optimizer(
    inner: optax.GradientTransformation,
    mesh: Mesh,
    *,
    axis_name: AxisName = "dp",
    partition: str = "auto",
    reduce: str = "mean",
    bucket_cap_mb: float = 25.0,
    order: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
) -> ShardedOptimizer:
    """Wrap ``inner`` so each device along ``axis_name`` keeps 1/N of its state (ZeRO).

    ``init(params)`` runs outside ``shard_map`` (also under ``jax.eval_shape``) and returns a
    ``ZeroState`` already placed with ``state_shardings(params)``. ``update(grads, state,
    params)`` runs inside ``jax.shard_map`` with ``in_specs=tx.state_specs(params)`` for the
    state; ``grads`` are LOCAL (docs/design.md §7: ``make_local`` / ``value_and_local_grad``),
    and it returns the FULL update, identical on every device, plus the new sharded state.

    Args:
        inner: any Optax transformation (``optax.chain``, schedules, ``inject_hyperparams``
            work). For global-norm clipping put ``gradsync_jax.clip_by_global_norm`` first
            in it.
        mesh: the mesh the training step's ``shard_map`` runs on.
        axis_name: the data-parallel axis (or tuple of axes) the batch is split over.
        partition: ``"auto"`` (default): ``"flat"`` when the inner update is proven
            elementwise, else ``"greedy"`` when proven exact per tensor, else
            ``"gathered"``: the state stored with greedy's owners, the update run on the
            whole tree on every device (exact for any optimizer, global norms and
            learning-rate estimates included; the whole state in transient memory).
            ``"greedy"``: whole parameters per device
            (``plan_greedy_shards``, the owners torch's ZeRO optimizer picks), for optimizers
            whose update of a tensor reads only that tensor (Adafactor, LAMB). ``"flat"``:
            element ranges of gradient buckets, one reduce-scatter and one all-gather per
            bucket, elementwise optimizers only. Decided from the jaxpr of the inner update
            (docs/jax-zero.md, "Soundness"); what cannot be proven exact is refused.
        reduce: ``"mean"`` divides the local gradients by N before the sum; ``"sum"`` does not.
        bucket_cap_mb: in MiB, as torch's DDP and ``gradsync_torch`` take it. ``"flat"``: the
            gradient bucket size; ``"greedy"``: the size of the column chunks its packed
            gradients are reduce-scattered in.
        order: torch names in registration order, as ``torch_specs`` takes it: greedy owners
            break ties between equal sizes in this order, as torch's ZeRO optimizer does, so a
            model whose Flax tree sorts otherwise (attention ``q, k, v, o``; a module's own
            parameter before its children's) gets torch's owners. Default: natural order.
            Flat buckets are laid out in it too. To continue a torch checkpoint with its owners:
            ``order=[p.name for p in gradsync_core.read_manifest(path).params]``.
        modules: the Flax-to-torch module renames that give ``order``'s names.

    Returns:
        A ``ShardedOptimizer`` (an ``optax.GradientTransformationExtraArgs``).

    Raises:
        ValueError: on an unknown partition/reduce, a non-positive ``bucket_cap_mb``, an
            axis the mesh lacks, or, for ``"greedy"``/``"flat"``, an inner update that reads
            other tensors than the one it updates (``optax.clip_by_global_norm``,
            ``polyak_sgd``), here, at ``init`` or at the first trace.
            ``NotElementwiseError`` (a ``ValueError``) for ``"flat"`` and a
            non-elementwise inner update.

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
    if not bucket_cap_mb > 0:
        raise ValueError(f"bucket_cap_mb must be positive (MiB), got {bucket_cap_mb!r}")
    axes = axis_tuple(axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"axis {missing[0]!r} is not an axis of the mesh {mesh.axis_names}")
    given, inner = inner, optax.with_extra_args_support(inner)
    check_on_sample(given, inner, partition)
    settings = ZeroSettings(
        inner=inner,
        given=given,
        mesh=mesh,
        axis_name=axis_name,
        partition=partition,
        reduce=reduce,
        bucket_cap_bytes=max(1, int(bucket_cap_mb * MIB)),
        order=None if order is None else tuple(order),
        modules=None if modules is None else tuple(sorted(modules.items())),
    )
    return ShardedOptimizer(_ZeroTransform(settings))
