"""A jitted pipeline-parallel training step: one ``shard_map`` over a mesh with a ``pp`` axis.

Each pipeline group (the ``pp`` fibre of the mesh, ``Topology.groups("pp")``) runs the plan on
its data-parallel share of the batch (``tick loop``, ``loop.py``); the gradients of a stage are
then final, so they are reduced over the data-parallel axis, once (the plan's
``REDUCE_GRAD``), and the Optax transformation updates each rank's own stages. A
``shard_optimizer(...)`` over ``dp`` reduce-scatters them itself and keeps 1/dp of the state
(ZeRO-1); any other Optax transformation gets the mean over ``dp`` first. A ``zero3`` plan
keeps the parameters cut over ``dp`` too (ZeRO-3, ``sharded.py``): gathered before the tick
loop, the gradient sums reduce-scattered after it, the update on the chunks.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import PipelinePlan
from gradsync_core.plan import HSDP_AXES
from gradsync_jax._axes import AxisName, axis_tuple, cast_varying, psum_mean
from gradsync_jax.data_parallel.accumulate import split_microbatches
from gradsync_jax.param_sharding.layout import ParamLayout
from gradsync_jax.param_sharding.placement import check_mesh, split_axes
from gradsync_jax.pipeline.layout import natural_state, pipeline_specs, pipeline_state
from gradsync_jax.pipeline.loop import run_pipeline
from gradsync_jax.pipeline.model import PARTS, PipelineModel
from gradsync_jax.pipeline.sharded import (
    StageGather,
    check_sharded,
    layout_tree,
    shard_leaf,
    sharded_specs,
    unshard_leaf,
)
from gradsync_jax.pipeline.split import STASH_MODES
from gradsync_jax.pipeline.ticks import TickProgram, compile_ticks
from gradsync_jax.zero import NotElementwiseError, ShardedOptimizer, shard_optimizer

PP = "pp"


class PipelineStep:
    """What ``pipeline_step`` returns: ``step(params, opt_state, batch) -> (params,
    opt_state, loss)``, jitted, plus ``init`` (the optimizer state), ``lower`` (for
    ``.compile().memory_analysis()``) and ``program`` (the compiled tick tables)."""

    def __init__(
        self,
        model: PipelineModel,
        tx: optax.GradientTransformation,
        mesh: Mesh,
        plan: PipelinePlan,
        *,
        stash: str,
        axis_name: AxisName,
        param_specs: Any = None,
        layout: ParamLayout | None = None,
    ) -> None:
        self.model, self.tx, self.mesh, self.plan = model, tx, mesh, plan
        self.param_specs = param_specs
        self.layout = layout
        self.stash = stash
        self.axes = data_axes(mesh, axis_name)
        self.axis_name = axis_name
        self._gather: StageGather | None = None
        if layout is not None:
            shard, replicate = split_axes(layout, mesh, axis_name)
            self.shard_axes = shard
            self._gather = StageGather(layout, shard, replicate)
        self.program: TickProgram = compile_ticks(plan)
        self._checked: set[Any] = set()
        self._jitted = jax.jit(self._mapped)

    # -- the optimizer state -------------------------------------------------------------

    def _local(self, params: Any, rank: int) -> Any:
        """Pipeline rank ``rank``'s view of pipeline-layout ``params`` (leaves ``(1, ...)``),
        on the host."""
        return jax.tree.map(lambda leaf: np.asarray(leaf)[rank : rank + 1], params)

    @staticmethod
    def _abstract_local(params: Any) -> Any:
        return jax.tree.map(
            lambda leaf: jax.ShapeDtypeStruct((1, *jnp.shape(leaf)[1:]), leaf.dtype), params
        )

    def _base_specs(self, local: Any, state: Any) -> Any:
        if isinstance(self.tx, ShardedOptimizer):
            return self.tx.state_specs(local)
        if self.param_specs is None and self.layout is None:
            return jax.tree.map(lambda _: P(), state)
        # a rank's own parameters: the pipeline specs with pp's place left to the stacking
        own = jax.tree.map(lambda spec: P(None, *spec[1:]), self.specs(local), is_leaf=_is_spec)
        return optax.tree_map_params(
            self.tx, lambda _, spec: spec, state, own, transform_non_params=lambda _: P()
        )

    def specs(self, params: Any) -> Any:
        """The ``PartitionSpec`` of every pipeline-layout parameter (``pipeline_specs``; a
        ``zero3`` plan's chunks ``sharded_specs``)."""
        if self.layout is not None:
            return sharded_specs(params, self.shard_axes)
        return pipeline_specs(params, self.param_specs)

    def state_specs(self, params: Any) -> Any:
        """The ``PartitionSpec`` of every optimizer-state leaf: each pipeline rank's state of
        its own stages, stacked on a leading ``pp`` dimension."""
        local = self._abstract_local(params)
        state = jax.eval_shape(self.tx.init, local)
        return _with_pp(self._base_specs(local, state))

    def init(self, params: Any) -> Any:
        """The optimizer state of pipeline-layout ``params``: ``tx.init`` of each pipeline
        rank's own parameters, stacked on a leading ``pp`` dimension.

        Raises:
            ValueError: if the update reads across elements (``check_elementwise``).
        """
        self.check_params(params)
        self.check_elementwise(params)
        return self._place(
            [self.tx.init(self._local(params, r)) for r in range(self.plan.pp)], params
        )

    @property
    def inner(self) -> optax.GradientTransformation:
        """The Optax transformation the state belongs to (a ``shard_optimizer``'s inner)."""
        return self.tx.settings.given if isinstance(self.tx, ShardedOptimizer) else self.tx

    def natural_state(self, opt_state: Any, params: Any) -> Any:
        """The state ``inner.init(natural_params(params, plan))`` would hold: what the
        unpipelined step's optimizer holds, on the host (NumPy); save it beside
        ``natural_params`` and continue with any pp (``pipeline_state``)."""
        per_rank = [
            jax.tree.map(lambda x, r=r: np.asarray(x)[r], opt_state) for r in range(self.plan.pp)
        ]
        if isinstance(self.tx, ShardedOptimizer):
            local = self._abstract_local(params)
            per_rank = [self.tx.gather_state(s, local) for s in per_rank]
        if self.layout is not None:
            per_rank = [self._map_state(s, unshard_leaf) for s in per_rank]
        return natural_state(self.inner, per_rank, params, self.plan)

    def _map_state(self, state: Any, fn: Any) -> Any:
        """``fn(leaf, LeafLayout)`` of every parameter-shaped leaf of a rank's ``state``."""
        assert self.layout is not None
        return optax.tree_map_params(
            self.inner, fn, state, layout_tree(self.layout), transform_non_params=lambda x: x
        )

    def pipeline_state(self, state: Any, params: Any) -> Any:
        """``natural_state``'s inverse: the step's optimizer state from the unpipelined one
        (``inner.init(natural)``'s structure), placed on the mesh."""
        self.check_params(params)
        per_rank = pipeline_state(self.inner, state, params, self.plan, _blocks_per_stage(params))
        if isinstance(self.tx, ShardedOptimizer):
            local = self._abstract_local(params)
            per_rank = [self.tx.scatter_state(s, local) for s in per_rank]
        if self.layout is not None:
            n = self.layout.world_size
            per_rank = [
                self._map_state(s, lambda x, leaf: shard_leaf(x, leaf, n)) for s in per_rank
            ]
        return self._place(per_rank, params)

    def _place(self, states: list[Any], params: Any) -> Any:
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *states)
        specs = self.state_specs(params)
        return jax.device_put(
            stacked,
            jax.tree.map(lambda spec: NamedSharding(self.mesh, spec), specs, is_leaf=_is_spec),
        )

    def check_elementwise(self, params: Any) -> None:
        """Refuse, with one sentence, an update that reads across elements: each pipeline
        rank runs it on its own stages only, so a global norm (or a per-tensor statistic of
        the stacked blocks) would see a part of the model.

        Raises:
            ValueError: for ``optax.clip_by_global_norm``, LAMB, Adafactor and the like.
        """
        local = self._abstract_local(params)
        key = jax.tree.structure(local), tuple((x.shape, x.dtype) for x in jax.tree.leaves(local))
        if key in self._checked:
            return
        inner = self.tx.settings.given if isinstance(self.tx, ShardedOptimizer) else self.tx
        try:
            flat = shard_optimizer(inner, self.mesh, axis_name=self.axes, partition="flat")
            jax.eval_shape(flat.init, local)
        except (NotElementwiseError, ValueError) as err:
            raise ValueError(
                "pipeline_step runs the optimizer on each pipeline rank's own stages, which is "
                "exact only for an update that treats every element on its own (SGD, Adam, "
                "AdamW, Lion, RMSProp); this one does not (" + str(err).split("; use ")[0] + ")"
            ) from err
        self._checked.add(key)

    # -- the step ------------------------------------------------------------------------

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        self.check_params(params)
        self._check_batch(batch)
        return self._jitted(params, opt_state, batch)

    def lower(self, params: Any, opt_state: Any, batch: Any) -> Any:
        """``jax.jit(step).lower(...)``: ``.compile().memory_analysis()`` gives the step's
        temporary bytes."""
        self.check_params(params)
        self._check_batch(batch)
        return self._jitted.lower(params, opt_state, batch)

    def check_params(self, params: Any) -> None:
        """Refuse parameters that are not in this plan's pipeline layout.

        Raises:
            ValueError: naming the leaf and the layout expected (``pipeline_params``).
        """
        pp, v = self.plan.pp, self.plan.stages_per_rank
        if not isinstance(params, dict) or set(params) != set(PARTS):
            raise ValueError(
                "pipeline parameters are a dict with keys 'embed', 'blocks' and 'head' in "
                "pipeline layout; convert natural ones with pipeline_params(params, plan)"
            )
        for key in PARTS:
            for leaf in jax.tree.leaves(params[key]):
                shape = jnp.shape(leaf)
                want = (pp, v) if key == "blocks" else (pp,)
                if shape[: len(want)] != want or (key == "blocks" and len(shape) < 3):
                    raise ValueError(
                        f"a leaf of params[{key!r}] has shape {shape}, not the pipeline layout's "
                        f"leading {'(pp, v, k)' if key == 'blocks' else '(pp,)'} = "
                        f"{want}; convert natural parameters with pipeline_params(params, plan)"
                    )
        ks = {jnp.shape(leaf)[2] for leaf in jax.tree.leaves(params["blocks"])}
        if len(ks) != 1:
            raise ValueError(f"the blocks' leaves disagree on the blocks per stage: {sorted(ks)}")
        if self.layout is not None:
            check_sharded(params, self.layout, pp, v)
        counts = [s.layout.count("t") for s in self.plan.stages]
        if any(s.layout for s in self.plan.stages) and set(counts) != ks:
            raise ValueError(
                f"the plan's layout {self.plan.layout!r} gives its stages {counts} blocks but "
                f"the parameters hold {ks.pop()} per stage; plan with input_weight=0, "
                "output_weight=0 so every stage holds the same number"
            )

    def _check_batch(self, batch: Any) -> None:
        if not (isinstance(batch, tuple | list) and len(batch) == 2):
            raise ValueError(
                "the batch is a pair (inputs, targets): embed reads the inputs and head the "
                "targets of each microbatch"
            )
        dp = 1
        for a in self.axes:
            dp *= self.mesh.shape[a]
        multiple = dp * self.plan.microbatches
        for leaf in jax.tree.leaves(batch):
            if jnp.ndim(leaf) == 0 or jnp.shape(leaf)[0] % multiple:
                raise ValueError(
                    f"a batch leaf has shape {jnp.shape(leaf)}; its leading dimension must be "
                    f"a multiple of dp size {dp} x microbatches {self.plan.microbatches} = "
                    f"{multiple}"
                )

    def _mapped(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        mesh = self.mesh
        param_specs = self.specs(params)
        state_specs = self.state_specs(params)
        batch_spec = P(self.axes[0] if len(self.axes) == 1 else self.axes)
        if all(t == AxisType.Explicit for t in mesh.axis_types):
            named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
            params = jax.reshard(params, jax.tree.map(named, param_specs, is_leaf=_is_spec))
            opt_state = jax.reshard(opt_state, jax.tree.map(named, state_specs, is_leaf=_is_spec))
            batch = jax.reshard(batch, named(batch_spec))
        return jax.shard_map(
            self._local_step,
            mesh=mesh,
            in_specs=(param_specs, state_specs, batch_spec),
            out_specs=(param_specs, state_specs, P()),
        )(params, opt_state, batch)

    def _local_step(self, params: Any, opt_state: Any, batch: Any) -> tuple[Any, Any, jax.Array]:
        m = self.plan.microbatches
        axes = (PP, *self.axes)
        own = tuple(jax.tree.map(lambda leaf: leaf[0], params[key]) for key in PARTS)
        gather = self._gather
        if gather is not None:  # ZeRO-3: the plan's UNSHARD, before the first forward
            own, reduce = jax.vjp(lambda chunks: cast_varying(gather(chunks), axes), own)
        own = cast_varying(own, axes)
        inputs, targets = split_microbatches(tuple(batch), m)
        loss_sum, (d_embed, d_blocks, d_head) = run_pipeline(
            self.model,
            self.program,
            own,
            inputs,
            targets,
            blocks_per_stage=_blocks_per_stage(params),
            stash=self.stash,
            axes=axes,
        )
        # torch's pipelining sums the microbatches' gradients, then divides (scale_grads)
        d_embed, d_blocks, d_head = jax.tree.map(lambda g: g / m, (d_embed, d_blocks, d_head))
        if gather is not None:  # RESHARD, REDUCE_GRAD: the sums reduce-scattered to the chunks
            ((d_embed, d_blocks, d_head),) = reduce((d_embed, d_blocks, d_head))
        # Only the first (last) stage's rank holds the embedding's (head's) gradient: the sum
        # over the pipeline adds zeros elsewhere, exactly.
        d_embed, d_head, loss_sum = lax.psum((d_embed, d_head, loss_sum), PP)
        grads = {"embed": d_embed, "blocks": d_blocks, "head": d_head}
        grads = cast_varying(jax.tree.map(lambda g: g[None], grads), (PP,))
        loss = lax.pmean(loss_sum / m, self.axes)
        if not isinstance(self.tx, ShardedOptimizer) and gather is None:
            grads = jax.tree.map(lambda g: psum_mean(g, self.axes, mean=True), grads)
        state = jax.tree.map(lambda leaf: leaf[0], opt_state)
        updates, state = self.tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return params, jax.tree.map(lambda leaf: leaf[None], state), loss


def data_axes(mesh: Mesh, axis_name: AxisName) -> tuple[str, ...]:
    """The data-parallel mesh axes ``axis_name`` names: ``"dp"`` on the mesh of a
    hybrid-sharding topology (no ``dp`` axis) is its ``dp_replicate`` and ``dp_shard``."""
    axes = axis_tuple(axis_name)
    names = set(mesh.axis_names)
    if axes == ("dp",) and "dp" not in names and set(HSDP_AXES) <= names:
        return ("dp_replicate", "dp_shard")  # the topology's rank order: mesh_axes("dp")
    return axes


def _blocks_per_stage(params: Any) -> int:
    """k, from pipeline-layout ``params`` (``check_params`` made it one number)."""
    return jax.tree.leaves(params["blocks"])[0].shape[2]


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def _with_pp(specs: Any) -> Any:
    return jax.tree.map(lambda spec: P(PP, *spec), specs, is_leaf=_is_spec)


def pipeline_step(
    model: PipelineModel,
    tx: optax.GradientTransformation,
    mesh: Mesh,
    plan: PipelinePlan,
    *,
    stash: str = "residuals",
    axis_name: AxisName = "dp",
    param_specs: Any = None,
    layout: ParamLayout | None = None,
) -> PipelineStep:
    """Build the pipeline-parallel step of ``plan`` (docs/pipeline.md, "The JAX executor").

    Args:
        model: the embedding, block and head functions (``PipelineModel``).
        tx: an elementwise Optax transformation (``optax.adamw(...)``), or a
            ``shard_optimizer(inner, mesh, axis_name=axis_name)`` over the data-parallel
            axis (ZeRO-1: 1/dp of each pipeline rank's state per device).
        mesh: the mesh, with a ``pp`` axis of the plan's size (``mesh_from_topology(
            plan.topology)``).
        plan: the pipeline plan (``plan_pipeline``); every stage must hold the same number of
            blocks (plan with ``input_weight=0, output_weight=0`` or a layout).
        stash: what a forward leaves its backward: ``"residuals"`` (default: the values
            ``jax.vjp`` keeps; no recomputation, every cell about one forward's work) or
            ``"input"`` (the stage input only; the input-gradient cell recomputes the
            forward: less memory, a third more compute).
        axis_name: the data-parallel mesh axis (or axes) the batch is split over; ``"dp"``
            on a hybrid-sharding topology's mesh is its ``dp_replicate`` and ``dp_shard``.
        param_specs: tensor parallelism inside a stage: a ``PartitionSpec`` tree like the
            parameters (a block's spec is one layer's, as ``nnx_model`` returns them), for
            blocks written with ``ColumnParallelLinear``/``RowParallelLinear`` over ``tp``.
            Place the parameters with ``pipeline_params(params, plan, mesh, param_specs)``.
            Default: only the pipeline shards them.
        layout: a ``zero3`` plan's cut of the parameters (ZeRO-3 over ``axis_name``:
            ``pipeline_layout(natural, plan)``); place them with ``pipeline_params(natural,
            plan, mesh, layout=layout)``. Required with a ``zero3`` plan, refused without.

    Returns:
        A ``PipelineStep``: ``step(params, opt_state, batch) -> (params, opt_state, loss)``
        on pipeline-layout parameters (``pipeline_params``), ``opt_state = step.init(
        params)``, ``batch = (inputs, targets)`` split over ``axis_name`` and then into the
        plan's microbatches; ``loss`` is the mean over the global batch.

    Raises:
        ValueError: if the mesh lacks ``pp`` or the plan's pp, the stash mode is unknown, a
            ``shard_optimizer`` was built for another mesh or axis, or a ``zero3`` plan comes
            without its ``layout`` (or a layout without a ``zero3`` plan, or with
            ``shard_optimizer`` or ``param_specs``).

    Example:
        >>> step = pipeline_step(model, optax.adamw(1e-3), mesh, plan)
        >>> params = pipeline_params(natural, plan)
        >>> params, opt_state, loss = step(params, step.init(params), (inputs, targets))
    """
    if PP not in mesh.axis_names or mesh.shape[PP] != plan.pp:
        raise ValueError(
            f"the plan runs pp = {plan.pp} pipeline ranks but the mesh has axes "
            f"{dict(mesh.shape)}; build it with mesh_from_topology(plan.topology)"
        )
    if stash not in STASH_MODES:
        raise ValueError(f"stash must be one of {STASH_MODES}, got {stash!r}")
    axes = data_axes(mesh, axis_name)
    missing = [a for a in axes if a not in mesh.axis_names]
    if missing or PP in axes:
        raise ValueError(
            f"axis_name {axis_name!r} must name data-parallel axes of the mesh "
            f"{mesh.axis_names} other than 'pp'"
        )
    if isinstance(tx, ShardedOptimizer) and (tx.mesh != mesh or tx.settings.axes != axes):
        raise ValueError(
            "tx is a shard_optimizer(...), which reduces the gradients itself: build it on the "
            "same mesh and axis_name as pipeline_step"
        )
    if isinstance(tx, ShardedOptimizer) and param_specs is not None:
        raise ValueError(
            "shard_optimizer plans its shards over whole parameters, not over tensor-parallel "
            "shards: with param_specs, pass the plain Optax transformation"
        )
    if plan.zero3 != (layout is not None):
        raise ValueError(
            "a zero3 plan shards the parameters: pass layout=pipeline_layout(natural, plan)"
            if plan.zero3
            else "layout= shards the parameters (ZeRO-3), which the plan must plan: make it "
            "with plan_pipeline(..., zero3=True)"
        )
    if layout is not None:
        if isinstance(tx, ShardedOptimizer):
            raise ValueError(
                "a zero3 plan keeps the optimizer state on the parameters' chunks already; "
                "pass the plain Optax transformation, not shard_optimizer(...)"
            )
        if param_specs is not None:
            raise ValueError(
                "a zero3 plan cuts whole parameters, not tensor-parallel shards: give either "
                "param_specs or a zero3 plan"
            )
        check_mesh(layout, mesh, axis_name)
    return PipelineStep(
        model,
        tx,
        mesh,
        plan,
        stash=stash,
        axis_name=axis_name,
        param_specs=param_specs,
        layout=layout,
    )
