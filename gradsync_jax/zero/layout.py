"""What a shard partition provides: the ``Layout`` protocol and the records it exchanges.

``shard_optimizer`` talks to its partition (``GreedyLayout``: whole parameters per device;
``FlatLayout``: element ranges of gradient buckets) only through this protocol, so the
transformation, the checkpoint code and the tests treat both alike (docs/design.md §4).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import jax
import numpy as np
import optax
from jax import lax

from gradsync_core import ShardPlan
from gradsync_jax.zero.model_space import ModelSpace


def materialize(arrays: list[jax.Array]) -> list[jax.Array]:
    """``arrays`` as computed buffers: XLA may not fuse their producers into the reader.

    A partition packs gradients into flat buffers (``concatenate``). Left to itself XLA fuses
    each gradient's producer into that concatenate, and into every reader of it: a bias
    gradient (a sum over the batch) then runs inside the GPU concatenate kernel, one output
    element per thread over all 4096 rows, once for ``mu`` and again for ``nu``. On one H200
    that made the 24 x 2048^2 step 3.6x the unsharded one (docs/jax-zero.md, "Performance").
    Behind ``lax.optimization_barrier`` every gradient is the ordinary kernel the unsharded
    step runs and the concatenate only copies. Applied per bucket or chunk, so a bucket still
    waits only for its own gradients and its reduce-scatter can overlap the backward pass.
    """
    return list(lax.optimization_barrier(list(arrays))) if arrays else []


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
    shards: dict[str, Any]  # device arrays; host arrays or specs where a layout builds them


class UpdateInputs(NamedTuple):
    """What one device hands its layout inside ``shard_map`` for one update."""

    grads: list[jax.Array]  # LOCAL gradients, one per parameter leaf
    state: ZeroState  # this device's view: shard rows of shape (1, L)
    params: list[Any] | None  # parameter leaves, if the inner update wants them
    extra_args: dict[str, Any]  # passed on to the inner update (a line search's value_fn)


class Collective(NamedTuple):
    """The data-parallel group the layout reduces over, and how."""

    axes: tuple[str, ...]
    mean: bool  # divide by the group size (``reduce="mean"``)


class UpdateResult(NamedTuple):
    """The full (replicated) updates, one per parameter leaf, and the new local state."""

    updates: list[jax.Array]
    state: ZeroState


class Layout(Protocol):
    """A partition of the inner optimizer state over ``n`` devices."""

    @property
    def space(self) -> ModelSpace: ...  # the unsharded state it stores

    @property
    def n(self) -> int: ...

    @property
    def plan(self) -> ShardPlan: ...  # owners, padding, imbalance

    def state_specs(self, spec_entry: Any) -> ZeroState:
        """The ``PartitionSpec`` of every state leaf, sharded over ``spec_entry``."""
        ...

    def local_shapes(self) -> list[tuple[int, ...]]:
        """The shape of every leaf of the inner state on one device (inside ``shard_map``),
        in flattening order: what a state passed with the wrong in_specs gets wrong."""
        ...

    def nbytes_per_device(self) -> int: ...

    def init_inputs(self, leaves: list[Any]) -> list[Any]:
        """The parameter leaves as ``init_local`` takes them (outside ``shard_map``)."""
        ...

    def init_sharded(self) -> bool:
        """Whether ``init_inputs`` are sharded over the axis (else replicated)."""
        ...

    def init_local(
        self, inner: optax.GradientTransformation, inputs: list[Any], axes: tuple[str, ...]
    ) -> ZeroState: ...

    def update_local(
        self,
        inner: optax.GradientTransformationExtraArgs,
        inputs: UpdateInputs,
        group: Collective,
    ) -> UpdateResult: ...

    def gather(self, state: ZeroState) -> list[np.ndarray]:
        """The unsharded inner state's leaves (NumPy), in ``space.leaves`` order."""
        ...

    def scatter(self, leaves: list[np.ndarray]) -> ZeroState:
        """Unsharded leaves -> a host-side ``ZeroState`` to place on the mesh."""
        ...
