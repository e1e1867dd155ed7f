"""Tensor/context-parallel layers in Flax NNX, and replicated_over derived (docs/design.md §6).

The layers hold GLOBAL parameters annotated with ``out_sharding`` (``(None, "tp")`` for a
column-parallel kernel), so a model is built, initialized and checkpointed on one device like
its serial twin — the two have the same parameter tree — and only its forward runs inside
``jax.shard_map``, where each device sees its shard and the mappings talk over the mesh.
A parameter's ``PartitionSpec`` says which axes it is sharded over; the input's spec says
which axes split the tokens; ``gradsync_core.replicated_axes`` derives the rest.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec

from gradsync_core import ParamSpec, replicated_axes
from gradsync_core.deprecation import renamed_keywords
from gradsync_jax._axes import spec_entry_axes
from gradsync_jax._specs import param_specs
from gradsync_jax.model_parallel.mappings import (
    all_gather_from,
    copy_to,
    reduce_from,
    reduce_scatter_to,
)

_default_init = nnx.initializers.lecun_normal()


def _param(value: jax.Array, sharding: tuple[Any, ...]) -> nnx.Param:
    # eager_sharding=False: keep the annotation as metadata; the value stays one global array
    # until the caller places it with the mesh (device_put / shard_map in_specs).
    return nnx.Param(value, out_sharding=sharding, eager_sharding=False)


class _ShardedLinear(nnx.Module):
    """Shared parts: ``y = x @ kernel + bias`` with one kernel dimension split on ``axis``.

    Subclasses say where the split is (``_kernel_spec`` / ``_bias_spec``, as functions of the
    axis name) and which mappings enter and leave the layer (``__call__``).
    """

    _kernel_spec: Callable[[str], tuple[Any, ...]]
    _bias_spec: Callable[[str], tuple[Any, ...]]

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        axis: str = "tp",
        use_bias: bool = True,
        sequence_parallel: bool = False,
        sequence_dim: int = 1,
        kernel_init: Callable[..., jax.Array] = _default_init,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.axis, self.sequence_parallel, self.sequence_dim = axis, sequence_parallel, sequence_dim
        kernel = kernel_init(rngs.params(), (in_features, out_features), param_dtype)
        self.kernel = _param(kernel, type(self)._kernel_spec(axis))
        bias = jnp.zeros((out_features,), param_dtype)
        self.bias = _param(bias, type(self)._bias_spec(axis)) if use_bias else None

    def _add_bias(self, y: jax.Array) -> jax.Array:
        return y if self.bias is None else y + self.bias[...]


class ColumnParallelLinear(_ShardedLinear):
    """``y = x @ kernel + bias`` with kernel columns (output features) and bias split on ``axis``.

    Input: replicated over ``axis`` (``copy_to``) or, with ``sequence_parallel``, this device's
    chunk of the sequence (``all_gather_from`` along ``sequence_dim``). Output: this device's
    feature chunk. ``out_features`` must divide by the axis size (a ``shard_map`` shard).

    Example:
        >>> fc1 = ColumnParallelLinear(8, 32, rngs=nnx.Rngs(0))  # kernel spec P(None, "tp")
    """

    @staticmethod
    def _kernel_spec(axis: str) -> tuple[Any, ...]:
        return (None, axis)

    @staticmethod
    def _bias_spec(axis: str) -> tuple[Any, ...]:
        return (axis,)

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.sequence_parallel:
            x = all_gather_from(x, self.axis, dim=self.sequence_dim)
        else:
            x = copy_to(x, self.axis)
        return self._add_bias(x @ self.kernel[...])


class RowParallelLinear(_ShardedLinear):
    """``y = x @ kernel + bias`` with kernel rows (input features) split on ``axis``.

    Input: this device's feature chunk. Partial products are summed with ``reduce_from``, or
    ``reduce_scatter_to`` along ``sequence_dim`` under sequence parallelism; the bias, added
    after, is unsharded.
    """

    @staticmethod
    def _kernel_spec(axis: str) -> tuple[Any, ...]:
        return (axis, None)

    @staticmethod
    def _bias_spec(axis: str) -> tuple[Any, ...]:
        return ()

    def __call__(self, x: jax.Array) -> jax.Array:
        y = x @ self.kernel[...]
        if self.sequence_parallel:
            y = reduce_scatter_to(y, self.axis, dim=self.sequence_dim)
        else:
            y = reduce_from(y, self.axis)
        return self._add_bias(y)


def nnx_functional(
    model: nnx.Module,
) -> tuple[Callable[[Any, jax.Array], jax.Array], dict[str, Any], dict[str, Any]]:
    """``(apply, params, specs)`` of an NNX model, as plain dicts for ``shard_map``.

    ``apply(params, x)`` rebuilds the model from ``params`` (a pure dict, global or this
    device's shards) and calls it; ``specs`` holds each parameter's ``PartitionSpec`` (from
    ``out_sharding``; ``P()`` when unannotated): the ``in_specs``/``out_specs`` for params.

    Example:
        >>> apply, params, specs = nnx_functional(model)  # model built from the layers above
        >>> step = jax.shard_map(fn, mesh=mesh, in_specs=(specs, P("dp", "cp")), ...)
    """
    graphdef, state = nnx.split(model, nnx.Param)
    params = nnx.to_pure_dict(state)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))

    def apply(params: Any, x: jax.Array) -> jax.Array:
        return nnx.merge(graphdef, params)(x)

    return apply, params, specs


def _local_shape(shape: tuple[int, ...], spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    out = list(shape)
    for dim, entry in enumerate(spec):
        parts = math.prod(mesh.shape[a] for a in spec_entry_axes(entry))
        if out[dim] % parts:
            raise ValueError(
                f"a dim of {out[dim]} is sharded as {entry!r} over {parts} devices, which "
                "does not divide it; shard_map needs even shards (pad the layer)"
            )
        out[dim] //= parts
    return tuple(out)


@renamed_keywords(data_spec="data_axes")
def shared_param_specs(
    params: Any, specs: Any, *, data_axes: PartitionSpec | Iterable[Any], mesh: Mesh
) -> list[ParamSpec]:
    """One ``ParamSpec`` per leaf (local shapes), ``replicated_over`` derived, never marked.

    Args:
        params: the parameter pytree (arrays or ``jax.ShapeDtypeStruct``, global shapes).
        specs: the matching ``PartitionSpec`` tree (``nnx_functional(model)[2]``).
        data_axes: the mesh axes the model's input is split over, as the input's
            ``PartitionSpec`` (``P("dp", "cp")``; ``P("dp", ("cp", "tp"))`` with sequence
            parallelism) or a tuple of axis names (``("dp", "cp")``, torch's spelling): every
            axis in it splits the tokens.
        mesh: the mesh the specs refer to (for the local shapes the reductions carry).

    Returns:
        Specs named like ``gradsync_jax.param_specs`` (``blocks/0/fc1/kernel``), ready for
        ``gradsync_core.plan_shared_reductions``; a leaf sharded over ``"ep"`` (the experts
        of ``gradsync_jax.model_parallel.experts.MoE``) gets ``expert=True``.

    Example:
        >>> specs = shared_param_specs(params, pspecs, data_axes=P("dp", "cp"), mesh=mesh)
        >>> [s.replicated_over for s in specs if s.name == "norm/scale"]
        [('cp',)]
    """
    # edp is the expert mesh's share of data parallelism: like dp, the data-parallel mean's.
    splitting = [a for entry in data_axes for a in spec_entry_axes(entry) if a != "edp"]
    treedef: Any  # jaxlib's PyTreeDef (no type information installed)
    leaves, treedef = jax.tree_util.tree_flatten(params)
    spec_leaves = treedef.flatten_up_to(specs)
    local = treedef.unflatten(
        [
            jax.ShapeDtypeStruct(_local_shape(tuple(x.shape), s, mesh), x.dtype)
            for x, s in zip(leaves, spec_leaves, strict=True)
        ]
    )
    out = []
    for spec, s in zip(param_specs(local), spec_leaves, strict=True):
        sharded = [a for entry in s for a in spec_entry_axes(entry)]
        replicated = replicated_axes(sharded_over=sharded, data_sharded_over=splitting)
        # Only expert weights are split over ep (gradsync_jax.model_parallel.experts): their
        # PartitionSpec is the layer's declaration that they are expert parameters.
        out.append(replace(spec, replicated_over=replicated, expert="ep" in sharded))
    return out
