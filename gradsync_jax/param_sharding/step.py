"""A ZeRO-3 training step: parameters, gradients and optimizer state all 1/N per device.

Each step runs in one ``jax.shard_map`` over the data-parallel axis: each parameter is
gathered where the loss first computes with it (``call_gathering_on_first_read``, order.py),
the backward reduce-scatters its gradient to the devices' chunks, and the Optax
transformation runs on the chunks, so its state is 1/N too. That is exact for an update made
of elementwise steps (SGD, Adam, AdamW, Lion, ...) and whole-tensor reductions, which
``RowsUpdate`` completes across the devices (global-norm clipping in either spelling, LAMB's
and LARS's trust ratios, ``apply_if_finite``; update.py); the jaxpr analysis of
``shard_optimizer`` proves it or the step is refused. A Muon's matrices are stepped whole on
their planned owners instead (``MatrixRowsUpdate``, matrices.py). With
``reshard_after_forward`` a gathered parameter is dropped after the equation that uses it and
gathered again for that equation's backward, as FSDP2's default; without it each unit is
kept from its first use to the backward.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core.deprecation import deprecated_keywords, renamed_keywords, warn_deprecated
from gradsync_core.options import takes_options
from gradsync_jax._axes import AxisName, axis_tuple, psum_mean
from gradsync_jax._compile_log import CompileLog
from gradsync_jax.data_parallel.accumulate import split_microbatches
from gradsync_jax.data_parallel.synced import SyncedState
from gradsync_jax.param_sharding.gather import Gatherer
from gradsync_jax.param_sharding.layout import ParamLayout
from gradsync_jax.param_sharding.matrices import MatrixRowsUpdate, rows_update
from gradsync_jax.param_sharding.options import Zero3Options
from gradsync_jax.param_sharding.order import call_gathering_on_first_read
from gradsync_jax.param_sharding.placement import axis_size, check_mesh, flat_leaves, split_axes
from gradsync_jax.param_sharding.policy import MixedPrecisionPolicy
from gradsync_jax.param_sharding.update import RowsUpdate, rows_tree
from gradsync_jax.zero.layout import ZeroState
from gradsync_jax.zero.transform import ShardedOptimizer

_LOG = logging.getLogger(__name__)


def _split(tree: Any, layout: ParamLayout) -> tuple[Any, Any]:
    """(trainable tree, frozen tree): the params' structure with ``None`` for the other kind."""
    leaves = flat_leaves(tree, layout, "params")
    trainable = [
        x if leaf.trainable else None for x, leaf in zip(leaves, layout.leaves, strict=True)
    ]
    frozen = [None if leaf.trainable else x for x, leaf in zip(leaves, layout.leaves, strict=True)]
    unflatten = partial(jax.tree_util.tree_unflatten, layout.treedef)
    return unflatten(trainable), unflatten(frozen)


def _join(trainable: Any, frozen: Any, layout: ParamLayout) -> Any:
    t = flat_leaves(trainable, layout, "trainable")
    f = flat_leaves(frozen, layout, "frozen")
    return jax.tree_util.tree_unflatten(
        layout.treedef, [a if b is None else b for a, b in zip(t, f, strict=True)]
    )


def _state_specs(tx: Any, layout: ParamLayout, axes: tuple[str, ...]) -> Any:
    """``P(axes)`` for the state leaves shaped like the chunks, ``P()`` for the rest (counts).

    Found by initializing on the chunks and on the whole padded parameters: a leaf whose shape
    follows the parameters' rows is per-parameter and stays sharded.
    """
    local = jax.eval_shape(tx.init, rows_tree(layout, lambda leaf: leaf.padded_rows))
    whole = jax.eval_shape(
        tx.init, rows_tree(layout, lambda leaf: leaf.padded_rows * layout.world_size + 1)
    )
    return jax.tree.map(lambda a, b: P() if a.shape == b.shape else P(axes), local, whole)


def _local_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    update: RowsUpdate | MatrixRowsUpdate,
    layout: ParamLayout,
    axes: tuple[str, ...],
    *,
    reshard_after_forward: bool,
    accumulate_steps: int,
    mp_policy: MixedPrecisionPolicy,
    replicate: tuple[str, ...],
) -> Callable[[Any, Any, Any, Any], Any]:
    """The step of one device inside ``shard_map``: gather, differentiate
    (``accumulate_steps`` micro-steps, each reduce-scattering its gradients to the chunks),
    update the chunks; ``replicate``: the replicate mesh axes (HSDP), else ``()``."""

    gather = Gatherer(layout, axes, mp_policy=mp_policy, replicate=replicate)

    def loss_of(trainable: Any, frozen: Any, batch: Any) -> jax.Array:
        chunks = [
            a if b is None else b
            for a, b in zip(
                flat_leaves(trainable, layout, "t"), flat_leaves(frozen, layout, "f"), strict=True
            )
        ]
        return call_gathering_on_first_read(
            lambda whole, b: loss_fn(jax.tree_util.tree_unflatten(layout.treedef, whole), b),
            chunks,
            gather,
            batch,
            reshard=reshard_after_forward,
        )

    grad_fn = jax.value_and_grad(loss_of)

    def grads_of(trainable: Any, frozen: Any, batch: Any) -> tuple[jax.Array, Any]:
        if accumulate_steps == 1:
            return grad_fn(trainable, frozen, batch)
        # Each micro-step reduce-scatters its own gradients and the chunks are summed: the
        # accumulator stays 1/N (FSDP2's default). Deferring the reduce-scatter to the last
        # micro-step would hold every unit's whole gradient across the micro-steps, the
        # memory ZeRO-3 exists to remove.
        micro = split_microbatches(batch, accumulate_steps)

        def body(carry: Any, mb: Any) -> tuple[Any, None]:
            loss, grads = grad_fn(trainable, frozen, mb)
            return (carry[0] + loss, jax.tree.map(jnp.add, carry[1], grads)), None

        first = grad_fn(trainable, frozen, jax.tree.map(lambda leaf: leaf[0], micro))
        rest = jax.tree.map(lambda leaf: leaf[1:], micro)
        (loss, grads), _ = lax.scan(body, first, rest)
        return loss / accumulate_steps, jax.tree.map(lambda g: g / accumulate_steps, grads)

    def body(trainable: Any, frozen: Any, opt_state: Any, batch: Any) -> Any:
        loss, grads = grads_of(trainable, frozen, batch)
        updates, opt_state = update(grads, opt_state, trainable, axes)
        trainable = optax.apply_updates(trainable, updates)
        return trainable, opt_state, psum_mean(loss, replicate + axes, mean=True)

    return body


def _data_axes(
    layout: ParamLayout, mesh: Mesh, axis_name: AxisName, replicate_axis_name: AxisName | None
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(shard axes, replicate axes), after checking the layout's sizes match them; on the
    mesh of a hybrid-sharding topology ``"dp"`` implies both (``split_axes``)."""
    axes = check_mesh(layout, mesh, axis_name)
    want = layout.plan.replicate_size
    if replicate_axis_name is None:
        replicate_axis_name = split_axes(layout, mesh, axis_name)[1] or None
    if replicate_axis_name is None:
        if want != 1:
            raise ValueError(
                f"the layout replicates over {want} groups (replicate_size={want}) but no "
                "replicate_axis_name was given; pass zero3_step(..., replicate_axis_name=<mesh "
                "axis>), or run on mesh_from_topology(Topology.create(..., dp_shard=...))"
            )
        return axes, ()
    have = axis_size(mesh, replicate_axis_name)
    if have != want:
        shard = layout.world_size
        raise ValueError(
            f"the layout was planned with replicate_size={want} but the mesh axis "
            f"{replicate_axis_name!r} has {have} devices; make it with param_layout(params, "
            f"world_size={have * shard}, dp_shard={shard})"
        )
    return axes, axis_tuple(replicate_axis_name)


class Zero3Step:
    """``step(params, opt_state, batch) -> (params, opt_state, loss)`` on sharded parameters;
    ``init(params)`` makes the sharded optimizer state.

    ``zero3_step`` makes one from its keywords or its ``Zero3Options``; the constructor takes
    the record (arguments as ``zero3_step``'s).

    Raises:
        ValueError, TypeError: as ``zero3_step``.

    Example:
        >>> step = Zero3Step(loss_fn, optax.adamw(1e-3), mesh, layout, Zero3Options())
    """

    def __init__(
        self,
        loss_fn: Callable[[Any, Any], jax.Array],
        tx: optax.GradientTransformation,
        mesh: Mesh,
        layout: ParamLayout,
        options: Zero3Options | None = None,
    ) -> None:
        options = Zero3Options() if options is None else options
        axes, replicate = _data_axes(layout, mesh, options.axis_name, options.replicate_axis_name)
        _refuse_syncing(tx, layout)
        tx = optax.with_extra_args_support(tx)
        update = rows_update(tx, layout)  # refuses what it cannot run exactly
        self.options = options
        self.layout, self.mesh, self.tx, self.axes = layout, mesh, tx, axes
        self.rows_update = update  # tx.update on the rows, its whole-tensor sums completed
        self.accumulate_steps = options.accumulate_steps
        spec = P(axes)
        batch_spec = P(replicate + axes) if options.batch_spec is None else options.batch_spec
        self.state_specs = _state_specs(tx, layout, axes)
        body = _local_step(
            loss_fn,
            update,
            layout,
            axes,
            reshard_after_forward=options.reshard_after_forward,
            accumulate_steps=options.accumulate_steps,
            mp_policy=options.mp_policy,
            replicate=replicate,
        )
        mapped = jax.shard_map(
            body,
            mesh=mesh,
            in_specs=(spec, spec, self.state_specs, batch_spec),
            out_specs=(spec, self.state_specs, P()),
        )
        explicit = all(t == AxisType.Explicit for t in mesh.axis_types)
        self._step_log = CompileLog(_LOG, "zero3_step")
        self._init_log = CompileLog(_LOG, "zero3_step's optimizer init")
        whole = [jax.ShapeDtypeStruct(leaf.shape, np.dtype(leaf.dtype)) for leaf in layout.leaves]

        def step(params: Any, opt_state: Any, batch: Any) -> Any:
            self._step_log.tracing(whole)  # the parameters' shapes, not the padded chunks
            if explicit:  # Explicit axes: shard_map inputs must already carry its in_specs
                batch = jax.reshard(batch, NamedSharding(mesh, batch_spec))
            trainable, frozen = _split(params, layout)
            trainable, opt_state, loss = mapped(trainable, frozen, opt_state, batch)
            return _join(trainable, frozen, layout), opt_state, loss

        compiler_options = options.compiler_options
        self._step = jax.jit(
            step,
            donate_argnums=(0, 1) if options.donate else (),
            compiler_options=None if compiler_options is None else dict(compiler_options),
        )
        init = jax.shard_map(
            lambda t: update.init(t, axes), mesh=mesh, in_specs=(spec,), out_specs=self.state_specs
        )

        def init_state(params: Any) -> Any:
            self._init_log.tracing(whole)
            return init(_split(params, layout)[0])

        self._init = jax.jit(init_state)

    def check_batch(self, batch: Any) -> None:
        """Refuse a batch whose leading dimension does not split over devices and micro-steps."""
        devices = self.layout.plan.world_size  # the replicas' devices too (HSDP)
        multiple = devices * self.accumulate_steps
        for leaf in jax.tree.leaves(batch):
            if np.ndim(leaf) == 0 or np.shape(leaf)[0] % multiple:
                raise ValueError(
                    f"a batch leaf has shape {np.shape(leaf)}; its leading dimension must be a "
                    f"multiple of {devices} devices x accumulate_steps "
                    f"{self.accumulate_steps} = {multiple}"
                )

    def init(self, params: Any) -> Any:
        """The optimizer state of the sharded ``params``: each device its chunks' state."""
        return self._init_log.call(self._init, params)

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        self.check_batch(batch)
        return self._step_log.call(self._step, params, opt_state, batch)

    def lower(self, params: Any, opt_state: Any, batch: Any) -> Any:
        """The jitted step lowered for these arguments (``.as_text()``, ``.compile()``)."""
        return self._step.lower(params, opt_state, batch)


def _refuse_syncing(tx: optax.GradientTransformation, layout: ParamLayout) -> None:
    """The gather's backward already reduce-scatters the gradients: a ``tx`` that syncs them
    again (``synced``, ``shard_optimizer``) would reduce twice. Its state, initialised on the
    parameters' shapes, shows whether it holds a sync."""
    like = jax.tree_util.tree_unflatten(
        layout.treedef, [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype) for leaf in layout.leaves]
    )
    probe = jax.eval_shape(tx.init, like)
    is_sync = lambda x: isinstance(x, (SyncedState, ZeroState))  # noqa: E731
    if isinstance(tx, ShardedOptimizer) or any(
        is_sync(x) for x in jax.tree.leaves(probe, is_leaf=is_sync)
    ):
        raise ValueError(
            "zero3_step reduce-scatters the gradients itself; pass the plain Optax "
            "transformation (optax.adamw(...)) without synced(...) or shard_optimizer"
        )


def _policy(
    mp_policy: MixedPrecisionPolicy | None, param_dtype: Any, reduce_dtype: Any
) -> MixedPrecisionPolicy:
    """``mp_policy``, or the one its deprecated spellings ``param_dtype=``/``reduce_dtype=``
    give (warned once)."""
    if param_dtype is None and reduce_dtype is None:
        return MixedPrecisionPolicy() if mp_policy is None else mp_policy
    if mp_policy is not None:
        raise TypeError(
            "zero3_step() got mp_policy= and its deprecated spellings param_dtype=/"
            "reduce_dtype=; put the dtypes in the MixedPrecisionPolicy"
        )
    warn_deprecated(
        "zero3_step(param_dtype=, reduce_dtype=)",
        "zero3_step(mp_policy=MixedPrecisionPolicy(param_dtype=, reduce_dtype=))",
    )
    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


@renamed_keywords(replicate_axis="replicate_axis_name")
@deprecated_keywords(
    param_dtype="mp_policy=MixedPrecisionPolicy(param_dtype=)",
    reduce_dtype="mp_policy=MixedPrecisionPolicy(reduce_dtype=)",
)
@takes_options(Zero3Options)
def zero3_step(
    loss_fn: Callable[[Any, Any], jax.Array],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    layout: ParamLayout,
    *,
    options: Zero3Options | None = None,
    axis_name: AxisName = "dp",
    reshard_after_forward: bool = True,
    batch_spec: Any = None,
    donate: bool = False,
    accumulate_steps: int = 1,
    mp_policy: MixedPrecisionPolicy | None = None,
    replicate_axis_name: AxisName | None = None,
    compiler_options: Mapping[str, Any] | None = None,
    param_dtype: Any = None,
    reduce_dtype: Any = None,
) -> Zero3Step:
    """A jitted ZeRO-3 training step over ``axis_name`` executing ``layout``'s plan.

    The options come as the keywords below or as one ``Zero3Options`` record (``options=``,
    the same names), not both.

    Args:
        loss_fn: ``loss_fn(params, batch) -> scalar``, the mean loss of a (local) batch, with
            ``params`` the whole Flax tree, exactly as for one device.
        tx: an Optax transformation made of elementwise steps and whole-tensor reductions
            (``optax.adamw``, ``optax.sgd``, ``optax.lamb``, ``optax.chain(
            optax.clip_by_global_norm(1.0), optax.adamw(...))``); it runs on each device's
            chunks, each whole-tensor reduction completed across the devices; or an
            ``optax.contrib.muon``, whose matrices are stepped whole on their planned owners
            (docs/matrix-optimizers.md).
        mesh: the mesh; ``shard_params(params, mesh, layout)`` placed the parameters on it.
        layout: from ``param_layout``.
        options: the options below as one ``Zero3Options`` (then give none of them).
        axis_name: the data-parallel axis (or tuple of axes); gradients are averaged over it.
            On the mesh of a hybrid-sharding topology (``mesh_from_topology`` of a
            ``Topology`` with ``dp_shard``) ``"dp"`` is its ``"dp_shard"`` axis, with
            ``"dp_replicate"`` the replicate axis, for a layout planned with that
            ``dp_shard``.
        reshard_after_forward: drop each gathered parameter after the equation that computes
            with it and gather it again for that equation's backward (FSDP2's default);
            ``False`` keeps each unit from its first use to the backward (less
            communication, more memory).
        batch_spec: in-spec of the batch; default ``P(axis_name)`` (split on the leading dim).
        donate: donate the parameters and optimizer state buffers to the step.
        accumulate_steps: split each device's batch into this many micro-batches; each
            micro-step reduce-scatters its gradients (the accumulator is 1/N, as FSDP2's
            default) and the step equals one step on the whole batch.
        mp_policy: mixed precision, FSDP2's ``MixedPrecisionPolicy``
            (``gradsync_jax.MixedPrecisionPolicy(param_dtype=jnp.bfloat16,
            reduce_dtype=jnp.float32)``): the chunks are cast to ``param_dtype`` before the
            all-gather, so the model computes in it, and the gradients reduce-scattered in
            ``reduce_dtype`` (default ``param_dtype``) and cast back; the stored chunks and
            the optimizer stay in their own dtype (fp32 master parameters). Default: no cast.
        replicate_axis_name: hybrid sharding (HSDP) on a 2-D mesh: parameters are cut over
            ``axis_name`` and replicated over this mesh axis (a layout made with
            ``param_layout(..., world_size=R * S, dp_shard=S)``); gradients are
            reduce-scattered over ``axis_name``, then all-reduced over this axis, the mean
            FSDP2's over both. The batch is split over both (default
            ``P((replicate_axis_name, axis_name))``). Implied by ``"dp"`` on a
            hybrid-sharding topology's mesh. (Was ``replicate_axis=``, deprecated.)
        compiler_options: XLA options for compiling the step (``jax.jit``'s), e.g.
            ``{"xla_allow_excess_precision": False}``.
        param_dtype: deprecated: ``mp_policy=MixedPrecisionPolicy(param_dtype=...)``.
        reduce_dtype: deprecated: ``mp_policy=MixedPrecisionPolicy(reduce_dtype=...)``.

    Returns:
        A ``Zero3Step``: ``opt_state = step.init(params)``, then
        ``params, opt_state, loss = step(params, opt_state, batch)``; ``loss`` is the mean
        over devices.

    Raises:
        ValueError: a mesh of another size than the layout's, or an update that reads
            across a tensor's elements other than by whole-tensor reductions, or across
            tensors (Adafactor's factored moments, Prodigy): one sentence that points
            to ``data_parallel_step`` with ``shard_optimizer(tx, mesh)``; a ``tx`` that syncs
            (``synced``, ``shard_optimizer``): the step reduce-scatters the gradients itself.
        TypeError: ``options`` together with any of its fields, or ``mp_policy`` (or
            ``options``) together with the deprecated ``param_dtype``/``reduce_dtype``.

    Example:
        >>> step = zero3_step(loss_fn, optax.adamw(1e-3), mesh, layout)
        >>> opt_state = step.init(params)
        >>> params, opt_state, loss = step(params, opt_state, batch)
    """
    if options is None:
        options = Zero3Options(
            axis_name=axis_name,
            reshard_after_forward=reshard_after_forward,
            batch_spec=batch_spec,
            donate=donate,
            accumulate_steps=accumulate_steps,
            mp_policy=_policy(mp_policy, param_dtype, reduce_dtype),
            replicate_axis_name=replicate_axis_name,
            compiler_options=compiler_options,
        )
    elif param_dtype is not None or reduce_dtype is not None:
        raise TypeError(
            "zero3_step() got options= and the deprecated param_dtype=/reduce_dtype=; put "
            "the dtypes in options.mp_policy"
        )
    return Zero3Step(loss_fn, tx, mesh, layout, options)
