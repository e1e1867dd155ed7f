"""Gradient synchronization over a data-parallel mesh axis (docs/design.md §7, §10).

Contract: ``sync_gradients`` takes LOCAL gradients — each device's gradient of its own batch
shard, varying over ``axis_name`` — and returns their mean (or sum) over ``axis_name``,
identical on every member; get local gradients with ``value_and_local_grad`` /
``local_grad`` or by differentiating w.r.t. ``make_local(params)``.

Why the contract: inside ``jax.shard_map(check_vma=True)``, ``jax.grad`` with respect to a
replicated (``P()``, invariant) parameter transposes the implicit broadcast into a ``psum``,
so the gradient arrives already summed over the batch axis. A following ``pmean`` then does
nothing and a ``psum`` counts the gradient ``N`` times — silently, and Adam's near scale
invariance hides it in the parameters (only its moments show it). gradsync keeps gradients
local by differentiating w.r.t. ``lax.pcast(params, axis, to="varying")`` and owns the one
reduction, so it can also bucket it, change its dtype and defer it (accumulation). A
gradient that is already invariant over the axis is refused with an error.

Inside ``jax.pmap`` (and ``shard_map(check_vma=False)``) JAX does not insert that ``psum``,
gradients are local by construction and ``sync_gradients`` works the same; the invariance
check is impossible there and skipped.

Model parallelism (docs/design.md §6): with ``shared=plan`` (a ``gradsync_core.ReductionPlan``),
``make_local``/``local_grad`` also keep the gradients of parameters replicated over a
model-parallel group PARTIAL (``make_shared_local``), and ``sync_gradients`` adds their sum
over that group to the dp mean, one variadic ``psum`` per bucket, once per step (after
accumulation, not at every use as JAX's implicit ``psum`` would).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from gradsync_core import BucketPlan, ReductionPlan
from gradsync_jax._axes import (
    AxisName,
    axis_tuple,
    cast_varying,
    display_axis,
    psum_mean,
    tracks_variance,
    varying,
)
from gradsync_jax._specs import leaf_names
from gradsync_jax.shared_reductions import (
    expert_names,
    make_shared_local,
    reduce_shared_gradients,
)


def make_local(
    tree: Any,
    axis_name: AxisName = "dp",
    *,
    shared: ReductionPlan | None = None,
    names: Sequence[str] | None = None,
) -> Any:
    """Mark every leaf of ``tree`` as varying over ``axis_name`` (``lax.pcast``).

    Differentiate w.r.t. the result to get local gradients inside ``shard_map``. Leaves that
    already vary are left alone; under ``pmap`` or ``check_vma=False`` this is the identity.
    With ``shared``, planned leaves also vary over their reduction group
    (``make_shared_local``; ``names`` as there), so their gradients stay partial until
    ``sync_gradients(..., shared=plan)`` sums them.

    Example:
        >>> grads = jax.grad(loss)(make_local(params, "dp"), batch)  # inside shard_map
    """
    if shared is not None:
        tree = make_shared_local(tree, shared, names=names)
    return cast_varying(tree, axis_tuple(axis_name))


def value_and_local_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    axis_name: AxisName = "dp",
    shared: ReductionPlan | None = None,
) -> Callable[..., Any]:
    """``jax.value_and_grad`` whose gradients stay local over ``axis_name`` (docs/design.md §7).

    Use inside ``shard_map``/``pmap``, then reduce with ``sync_gradients``.

    Args:
        fun: the loss, e.g. ``loss(params, batch) -> scalar`` (mean over the local batch).
        argnums, has_aux: as in ``jax.value_and_grad``.
        axis_name: the data-parallel mesh axis (or tuple of axes).
        shared: a ``ReductionPlan`` naming the leaves of the (single) differentiated
            argument: their gradients also stay partial over their model-parallel group.

    Returns:
        A function with ``fun``'s signature returning ``(value, local_grads)`` (value is
        ``(loss, aux)`` with ``has_aux``); the value is this device's, not averaged.

    Example:
        >>> loss, grads = value_and_local_grad(loss_fn)(params, batch)
        >>> grads = sync_gradients(grads, "dp")
    """
    positions = (argnums,) if isinstance(argnums, int) else tuple(argnums)
    if shared is not None and len(positions) != 1:
        raise ValueError(
            f"shared= names the leaves of one argument (the parameters) but argnums={argnums!r} "
            "differentiates several; pass argnums as one int"
        )
    grad_fn = jax.value_and_grad(fun, argnums=argnums, has_aux=has_aux)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        values = list(args)
        for i in positions:
            values[i] = make_local(values[i], axis_name, shared=shared)
        return grad_fn(*values, **kwargs)

    return wrapped


def local_grad(
    fun: Callable[..., Any],
    argnums: int | Sequence[int] = 0,
    *,
    has_aux: bool = False,
    axis_name: AxisName = "dp",
    shared: ReductionPlan | None = None,
) -> Callable[..., Any]:
    """``jax.grad`` whose gradients stay local over ``axis_name``; see ``value_and_local_grad``."""
    value_and_grad = value_and_local_grad(
        fun, argnums, has_aux=has_aux, axis_name=axis_name, shared=shared
    )

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        value, grads = value_and_grad(*args, **kwargs)
        return (grads, value[1]) if has_aux else grads

    return wrapped


def _check_leaf(name: str, leaf: Any, axes: tuple[str, ...], tracked: bool) -> None:
    if not jnp.issubdtype(leaf.dtype, jnp.inexact):
        raise TypeError(
            f"gradient {name!r} has dtype {leaf.dtype}; only floating gradients can be "
            "reduced (leave integer leaves out of the differentiated tree)"
        )
    if tracked and not set(axes) <= varying(leaf):
        axis = display_axis(axes)
        raise ValueError(
            f"gradient {name!r} is already invariant over {axis!r}: jax.grad inside "
            f"shard_map summed it over {axis!r} because its parameter is replicated (P()), so "
            "a pmean would silently do nothing and a psum would count it "
            f"{lax.axis_size(axes)} times. Differentiate w.r.t. make_local(params, {axis!r}) "
            "or use gradsync_jax.value_and_local_grad, then call sync_gradients."
        )


def _reduce(x: jax.Array, axes: tuple[str, ...], reduce: str, reduce_dtype: Any) -> jax.Array:
    """One collective in the wire dtype; where a mean divides is ``divide_after``'s rule."""
    dtype = x.dtype
    wire = x.astype(jnp.dtype(reduce_dtype or dtype))
    return psum_mean(wire, axes, mean=reduce == "mean").astype(dtype)


def sync_gradients(
    grads: Any,
    axis_name: AxisName = "dp",
    *,
    reduce: str = "mean",
    reduce_dtype: Any = None,
    plan: BucketPlan | None = None,
    names: Sequence[str] | None = None,
    shared: ReductionPlan | None = None,
) -> Any:
    """Mean (or sum) local gradients over ``axis_name``; call inside ``shard_map`` or ``pmap``.

    Without ``plan`` each leaf gets its own ``psum`` and XLA's all-reduce combiner merges them
    (measured not slower than bucketing on CPU, see docs/jax.md). With ``plan`` each
    bucket's gradients are reduced together, one ``psum`` in the bucket's wire dtype, with no
    copy into a flat buffer and back (alignment padding is not sent: it only matters for
    reduce-scatter); XLA's combiner merges the step's all-reduces as it merges the default's,
    so the compiled step has the same collectives either way (docs/jax.md).

    Args:
        grads: a pytree of local gradients (see the module docstring).
        axis_name: the data-parallel mesh axis, or a tuple of axes (``("dp", "cp")``).
        reduce: ``"mean"`` divides by the group size before the sum; ``"sum"`` does not.
        reduce_dtype: dtype on the wire (e.g. ``jnp.bfloat16``); the result is cast back to
            each gradient's dtype. Default: the gradient dtype.
        plan: a ``gradsync_core.BucketPlan`` whose slots name every leaf.
        names: the plan name of every leaf in flattening order; default
            ``path_name(key_path)`` (``params/Dense_0/kernel``). Pass
            ``gradsync_jax.torch_names(grads)`` to use a plan built from a torch module.
        shared: model parallelism (docs/design.md §6): a ``gradsync_core.ReductionPlan``
            (``plan_shared_reductions(shared_param_specs(...), topology)``); after the mean,
            each planned gradient is summed over its model-parallel group (in its own dtype),
            one ``psum`` per bucket. The gradients must be partial there: get them with
            ``local_grad(..., shared=plan)``. Expert parameters (the plan's ``"edp"``
            reduction, e.g. ``MoE``'s experts) are left out of the mean and summed over
            ``edp`` divided by the dense dp instead: ``axis_name`` must then be the expert
            mesh's ``("edp", "ep")`` and ``reduce="mean"``; ``plan`` covers the dense leaves.

    Returns:
        A pytree like ``grads``, identical on every member of the axis (and of the
        reduction groups of ``shared``).

    Raises:
        ValueError: on an unknown ``reduce``, a gradient already invariant over the axis
            (docs/design.md §7), a plan that does not cover exactly the (dense) leaves of
            ``grads``, a ``shared`` gradient already summed over its group, or an expert plan
            with ``reduce="sum"`` or an axis whose size is not the dense dp.
        TypeError: on a non-floating gradient leaf.
        NameError: if ``axis_name`` is not bound (called outside shard_map/pmap).

    Example:
        >>> def step(params, batch):  # inside jax.shard_map(..., in_specs=(P(), P("dp")))
        ...     grads = local_grad(loss_fn)(params, batch)
        ...     return sync_gradients(grads, "dp")
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    axes = axis_tuple(axis_name)
    tracked = tracks_variance(axes)
    leaves, treedef = jax.tree_util.tree_flatten(grads)
    names = leaf_names(grads, names, label="grads")
    experts = expert_names(shared)
    if experts:
        _check_expert_sync(shared, axes, reduce)  # type: ignore[arg-type]
    # Experts are held by different devices along ep, so a mean over the dense dp (which
    # spans ep) would mix different experts: their sum over edp comes from ``shared``.
    dense = [i for i, name in enumerate(names) if name not in experts]
    for i in dense:
        _check_leaf(names[i], leaves[i], axes, tracked)
    if plan is None:
        reduced = [_reduce(leaves[i], axes, reduce, reduce_dtype) for i in dense]
    else:
        reduced = _reduce_buckets(
            [leaves[i] for i in dense], [names[i] for i in dense], axes, reduce, reduce_dtype, plan
        )
    out = list(leaves)
    for i, value in zip(dense, reduced, strict=True):
        out[i] = value
    synced = jax.tree_util.tree_unflatten(treedef, out)
    if shared is None:
        return synced
    # The sum over a model-parallel group commutes with the dp mean (docs/design.md §6).
    return reduce_shared_gradients(synced, shared, names=names)


def _check_expert_sync(shared: ReductionPlan, axes: tuple[str, ...], reduce: str) -> None:
    divisor = shared.reduction("edp").divisor
    size = lax.axis_size(axes)
    if reduce != "mean" or size != divisor:
        raise ValueError(
            f"expert gradients are summed over edp and divided by the dense dp "
            f"({divisor}), which equals the global mean only beside a dense mean over dp; "
            f"got reduce={reduce!r} over axes {axes} of size {size}: "
            "pass reduce='mean' and the expert mesh's edp and ep axes as axis_name"
        )


def _reduce_buckets(
    leaves: list[jax.Array],
    names: list[str],
    axes: tuple[str, ...],
    reduce: str,
    reduce_dtype: Any,
    plan: BucketPlan,
) -> list[jax.Array]:
    position = {name: i for i, name in enumerate(names)}
    planned = {slot.name for slot in plan.slots}
    unplanned = [name for name in names if name not in planned]
    if unplanned:
        raise ValueError(
            f"gradient {unplanned[0]!r} has no slot in the bucket plan (of "
            f"{len(unplanned)} without one); build the plan from the same tree "
            "(plan_buckets(param_specs(params))) or pass names= mapping leaves to plan names"
        )
    plan.check_names(names, where="a leaf of grads")
    out: list[jax.Array | None] = [None] * len(leaves)
    for bucket in plan.buckets:
        members = []
        for slot in bucket.slots:
            i = position[slot.name]
            if leaves[i].size != slot.numel:
                raise ValueError(
                    f"gradient {slot.name!r} has shape {leaves[i].shape} but its plan slot "
                    f"has shape {slot.shape}; the plan was built for another model"
                )
            members.append(i)
        wire = jnp.dtype(reduce_dtype or leaves[members[0]].dtype)
        bucket_leaves = tuple(leaves[i].astype(wire) for i in members)
        reduced = psum_mean(bucket_leaves, axes, mean=reduce == "mean")
        for i, value in zip(members, reduced, strict=True):
            out[i] = value.astype(leaves[i].dtype)
    return out  # type: ignore[return-value]
