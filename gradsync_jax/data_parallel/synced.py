"""``synced``: the data-parallel gradient sync as an Optax transformation (docs/jax.md).

Optax composes by chaining small transformations, so the sync is one of them:
``optax.chain(synced("dp"), optax.adam(1e-3))`` turns LOCAL gradients into their mean over
``dp`` (``sync_gradients``) and hands the result to Adam. It is stateless: its state holds no
arrays, only the sync's settings as static pytree data (``SyncedState``), which is how
``data_parallel_step`` finds the sync inside any chain (to differentiate w.r.t. parameters
kept partial over the groups of a ``shared`` plan, and to refuse a second sync).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax

from gradsync_core import BucketPlan, ReductionPlan
from gradsync_jax._axes import AxisName, axis_tuple
from gradsync_jax.data_parallel.sync import sync_gradients


@jax.tree_util.register_static
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class SyncedState:
    """The state of ``synced``: no arrays, the sync's settings as static pytree data.

    Compared by identity (``eq=False``): one ``synced`` hands out one state object, so a
    jitted step keeps one compiled program and never hashes a plan of 10^5 slots per call.
    """

    axis_name: AxisName
    reduce: str = "mean"
    reduce_dtype: Any = None
    plan: BucketPlan | None = None
    shared: ReductionPlan | None = None

    @property
    def axes(self) -> tuple[str, ...]:
        return axis_tuple(self.axis_name)

    def sync(self, grads: Any) -> Any:
        """``sync_gradients`` with these settings (inside ``shard_map``/``pmap``)."""
        return sync_gradients(
            grads,
            self.axis_name,
            reduce=self.reduce,
            reduce_dtype=self.reduce_dtype,
            plan=self.plan,
            shared=self.shared,
        )


def synced(
    axis_name: AxisName = "dp",
    *,
    reduce: str = "mean",
    reduce_dtype: Any = None,
    plan: BucketPlan | None = None,
    shared: ReductionPlan | None = None,
) -> optax.GradientTransformationExtraArgs:
    """The data-parallel sync of LOCAL gradients as a stateless Optax transformation.

    Its update is ``sync_gradients(updates, axis_name, reduce=..., reduce_dtype=...,
    plan=..., shared=...)``, so put it first in a chain and run the chain inside
    ``jax.shard_map`` (or ``pmap``) on local gradients (docs/design.md §7). With a ``shared``
    plan the gradients must be partial over its groups (``local_grad(..., shared=plan)``;
    ``data_parallel_step`` does it), and expert parameters are summed over ``edp`` instead of
    averaged over ``axis_name`` (see ``sync_gradients``).

    Args:
        axis_name: the data-parallel mesh axis, or a tuple of axes.
        reduce, reduce_dtype, plan, shared: as in ``sync_gradients``.

    Returns:
        An ``optax.GradientTransformationExtraArgs`` whose state is a ``SyncedState`` (no
        arrays); extra arguments of the update are ignored.

    Raises:
        ValueError: on an unknown ``reduce`` or a malformed ``axis_name`` (here), and what
            ``sync_gradients`` raises (when the update is traced).

    Example:
        >>> tx = optax.chain(synced("dp", reduce_dtype=jnp.bfloat16), optax.adam(1e-3))
        >>> step = data_parallel_step(loss_fn, tx, mesh)
    """
    if reduce not in ("mean", "sum"):
        raise ValueError(f"reduce must be 'mean' or 'sum', got {reduce!r}")
    axis_tuple(axis_name)  # refuses a malformed axis now rather than at the first trace
    state = SyncedState(
        axis_name=axis_name, reduce=reduce, reduce_dtype=reduce_dtype, plan=plan, shared=shared
    )

    def init_fn(params: Any) -> SyncedState:
        del params
        return state

    def update_fn(
        updates: Any, state: SyncedState, params: Any = None, **extra_args: Any
    ) -> tuple[Any, SyncedState]:
        del params, extra_args
        return state.sync(updates), state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)
