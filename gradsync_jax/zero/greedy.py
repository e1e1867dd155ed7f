"""Greedy partition: each device owns whole parameters (ZeRO-1 ownership, docs/design.md §4).

Owners come from ``gradsync_core.plan_greedy_shards`` (torch's ``ZeroRedundancyOptimizer``
rule), so a torch job with the same parameter list picks the same owners; the matrices of a
Muon (``matrices.py``) come from ``gradsync_core.plan_matrix_owners`` instead, balanced by
Newton-Schulz work, the owners torch's ``MatrixOptimizer`` picks. Device ``d`` runs
the inner transformation on the whole tensors it owns, so any Optax optimizer works, Adafactor
included. The devices own different trees, so the update branches on ``lax.axis_index``
(``lax.switch``: each device executes only its own branch), and the per-parameter state lives
in row buffers (``rows``): ``(N, L)`` arrays sharded ``P(axis)``, one row per device.

One step: the gradients packed by owner and reduce-scattered (each device receives the
summed gradients of the tensors it owns), the inner update on them, then an all-gather of the
updates: the same bytes on the wire as one all-reduce.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradsync_core import Shard, ShardPlan, plan_greedy_shards
from gradsync_jax._axes import cast_varying, psum_scatter_mean, tracks_variance, varying
from gradsync_jax._naming import registration_order, torch_name
from gradsync_jax.zero.clip import global_norm_args
from gradsync_jax.zero.layout import (
    Collective,
    UpdateInputs,
    UpdateResult,
    ZeroState,
    materialize,
)
from gradsync_jax.zero.model_space import ModelSpace, as_dtype
from gradsync_jax.zero.rows import (
    DeviceState,
    OwnedRows,
    Rows,
    column_cuts,
    globals_tree,
    map_device_state,
    plan_rows,
)

# The branches of ``lax.switch`` must return equal types, and a device that owns nothing
# returns constants where the others return varying values: every branch output goes
# through ``cast_varying``.


class _Operands(NamedTuple):
    """The per-device inputs of the update branches."""

    chunks: list[list[jax.Array]]  # per gradient buffer: this device's reduced column chunks
    rows: list[jax.Array]  # this device's state rows, one per state buffer
    globals_: list[jax.Array]  # the global state leaves (replicated)
    params: list[Any] | None


def _uses(jaxpr: Any, var: Any) -> bool:
    """Whether ``jaxpr`` reads ``var`` (an operation's input or an output; a nested jaxpr
    gets it as an input of the operation that holds it)."""
    return any(v is var for eqn in jaxpr.eqns for v in eqn.invars) or any(
        v is var for v in jaxpr.outvars
    )


def _global_norm(chunks: list[list[jax.Array]], axes: tuple[str, ...]) -> jax.Array:
    squares = [jnp.sum(jnp.square(c)) for cs in chunks for c in cs]
    return jnp.sqrt(lax.psum(sum(squares, jnp.zeros((), jnp.float32)), axes))


@dataclass(frozen=True, slots=True, kw_only=True)
class GreedyLayout(OwnedRows):
    """Implements ``Layout``: device ``d`` stores the state of the parameters it owns."""

    space: ModelSpace
    n: int
    plan: ShardPlan
    owner: tuple[int, ...]  # per parameter leaf
    owned: tuple[tuple[int, ...], ...]  # per device: its parameter leaves, in tree order
    grads: Rows  # gradient rows (packed): keys are parameter leaves
    grad_cuts: tuple[tuple[int, ...], ...]  # per gradient buffer: column chunk boundaries
    state: Rows  # per-parameter state rows: keys are space indices of state leaves
    devices: tuple[DeviceState, ...]
    empty: DeviceState  # the state of a device that owns nothing: global leaves only

    def _inner(self, global_values: list[Any]) -> Any:
        return globals_tree(self.space, global_values)

    def _owned_tree(self, d: int, leaves: list[Any] | None) -> Any:
        if leaves is None:
            return None
        owned = set(self.owned[d])
        return self.space.param_treedef.unflatten(
            [leaf if i in owned else None for i, leaf in enumerate(leaves)]
        )

    def _split_state(self, device: DeviceState, state: Any) -> tuple[dict[int, Any], list[Any]]:
        """A device's inner state -> (per-parameter leaves by space index, global values)."""
        per_param, globals_ = {}, {}
        for (kind, index), leaf in zip(
            device.sources, device.treedef.flatten_up_to(state), strict=True
        ):
            if kind == "global":
                globals_[index] = as_dtype(leaf, self.space.leaves[index].dtype)
            else:
                per_param[index] = leaf
        return per_param, [globals_[i] for i in self.globals]

    def _state_of_device(self, device: DeviceState, rows: list[Any], globals_: list[Any]) -> Any:
        """A device's inner state (as ``inner.update`` takes it) from its rows and the globals."""
        by_index = dict(zip(self.globals, globals_, strict=True))
        leaves = [
            by_index[index]
            if kind == "global"
            else self.state.unpack(rows, index, self.space.leaves[index].shape)
            for kind, index in device.sources
        ]
        return device.treedef.unflatten(leaves)

    def _grad_chunk(self, grads: list[jax.Array], b: int, lo: int, hi: int) -> jax.Array:
        """Columns ``[lo, hi)`` of gradient buffer ``b``, all rows, flattened row by row.

        Rows hold each device's tensors latest-registered first (the order backward produces
        them) and are cut into column chunks of about ``bucket_cap_bytes``, so XLA can start
        a chunk's reduce-scatter while backward still runs. Its gradients are materialized
        first (``layout.materialize``), so the concatenate only copies them.
        """
        # per row: (leaf, start, stop) in the leaf's elements
        pieces: list[list[tuple[Any, int, int]]] = []
        for d in range(self.n):
            row: list[tuple[Any, int, int]] = []
            for i in self.grads.members[d][b]:
                offset = self.grads.slots[i][1]
                a, z = max(lo, offset), min(hi, offset + self.grads.numel[i])
                if a < z:
                    row.append((i, a - offset, z - offset))
            pieces.append(row)
        needed = sorted({i for row in pieces for i, _, _ in row})
        ready = dict(zip(needed, materialize([grads[i] for i in needed]), strict=True))
        parts = []
        for row in pieces:
            for i, start, stop in row:
                flat = ready[i].ravel()
                parts.append(flat if stop - start == flat.size else flat[start:stop])
            used = sum(stop - start for _, start, stop in row)
            if used < hi - lo:  # a row's padding lies after its tensors
                parts.append(jnp.zeros(hi - lo - used, self.grads.buffers[b][0]))
        return jnp.concatenate(parts)

    def _owned_grad(self, chunks: list[list[jax.Array]], i: int) -> jax.Array:
        """Gradient ``i`` from this device's reduced row, read from its chunks directly:
        concatenating them first copies the row (and XLA may fuse the copy into readers)."""
        spec = self.space.specs[i]
        if spec.numel == 0:
            return jnp.zeros(spec.shape, spec.dtype)
        b, offset = self.grads.slots[i]
        parts = []
        for c, (lo, hi) in enumerate(itertools.pairwise(self.grad_cuts[b])):
            a, z = max(lo, offset), min(hi, offset + spec.numel)
            if a < z:
                parts.append(chunks[b][c][a - lo : z - lo])
        return (parts[0] if len(parts) == 1 else jnp.concatenate(parts)).reshape(spec.shape)

    # -- inside shard_map ------------------------------------------------------------------

    def init_local(
        self, inner: optax.GradientTransformation, inputs: list[Any], axes: tuple[str, ...]
    ) -> ZeroState:
        def branch(d: int) -> Any:
            def run(params: list[Any]) -> Any:
                state = inner.init(self._owned_tree(d, params))
                per_param, globals_ = self._split_state(self.devices[d], state)
                return cast_varying((self.state.pack(d, per_param), globals_), axes)

            return run

        rows, globals_ = lax.switch(
            lax.axis_index(axes), [branch(d) for d in range(self.n)], inputs
        )
        # Every device computes the same global leaves (count, hyper-parameters); the switch
        # makes them device-varying, so take device 0's to return them replicated.
        globals_ = [lax.all_gather(g, axes, to="invarying")[0] for g in globals_]
        shards = dict(zip(self.state.names(), [r[None] for r in rows], strict=True))
        return ZeroState(inner=self._inner(globals_), shards=shards)

    def update_local(
        self,
        inner: optax.GradientTransformationExtraArgs,
        inputs: UpdateInputs,
        group: Collective,
    ) -> UpdateResult:
        """Reduce-scatter the gradients by owner, run each device's own inner update in a
        ``lax.switch`` branch, all-gather the updates."""
        chunks = [
            [
                psum_scatter_mean(
                    self._grad_chunk(inputs.grads, b, lo, hi), group.axes, self.n, mean=group.mean
                )
                for lo, hi in itertools.pairwise(cuts)
            ]
            for b, cuts in enumerate(self.grad_cuts)
        ]
        globals_ = list(jax.tree.leaves(inputs.state.inner))  # exactly the global leaves
        rows = [inputs.state.shards[name][0] for name in self.state.names()]
        operands = _Operands(chunks=chunks, rows=rows, globals_=globals_, params=inputs.params)
        update_rows, reads_norm = self._probe(inner, operands, inputs.extra_args)
        # The global norm for clip_by_global_norm, only if the probe read it: each device sums
        # the squares of what it owns, one scalar psum outside the branches (an unused psum
        # cannot always be removed by XLA).
        norm = _global_norm(chunks, group.axes) if reads_norm else None

        def branch(d: int) -> Any:
            def run(operands: _Operands) -> Any:
                u_leaves, state = self._owned_update(inner, d, operands, norm, inputs.extra_args)
                per_param, new_globals = self._split_state(self.devices[d], state)
                packed = (update_rows.pack(d, u_leaves), self.state.pack(d, per_param), new_globals)
                return cast_varying(packed, group.axes)

            return run

        u_rows, s_rows, new_globals = lax.switch(
            lax.axis_index(group.axes), [branch(d) for d in range(self.n)], operands
        )
        updates = self._gather_updates(update_rows, u_rows, group.axes)
        if norm is None:
            norm = jnp.zeros((), jnp.float32)  # not read by the inner update
        outside = self._global_update(
            inner, globals_, inputs.params, norm, inputs.extra_args, group.axes
        )
        if outside is None:  # device 0's values, replicated by a (tiny) all-gather
            outside = [lax.all_gather(g, group.axes, to="invarying")[0] for g in new_globals]
        new_shards = dict(zip(self.state.names(), [r[None] for r in s_rows], strict=True))
        return UpdateResult(updates=updates, state=ZeroState(self._inner(outside), new_shards))

    def _owned_update(
        self,
        inner: optax.GradientTransformationExtraArgs,
        d: int,
        operands: _Operands,
        norm: jax.Array | None,
        extra_args: dict[str, Any],
    ) -> tuple[dict[int, jax.Array], Any]:
        """Device ``d``'s inner update of the tensors it owns: (updates by leaf, new state).
        ``norm`` (the global gradient norm) is the extra argument ``global_norm``."""
        leaves: list[Any] = [None] * len(self.space.specs)
        for i in self.owned[d]:
            leaves[i] = self._owned_grad(operands.chunks, i)
        g_tree = self.space.param_treedef.unflatten(leaves)
        state = self._state_of_device(self.devices[d], operands.rows, operands.globals_)
        norm_args = {} if norm is None else global_norm_args(g_tree, norm)
        u_tree, state = inner.update(
            g_tree, state, self._owned_tree(d, operands.params), **extra_args, **norm_args
        )
        u_leaves = self.space.param_treedef.flatten_up_to(u_tree)
        return {i: u_leaves[i] for i in self.owned[d]}, state

    def _probe(
        self,
        inner: optax.GradientTransformationExtraArgs,
        operands: _Operands,
        extra_args: dict[str, Any],
    ) -> tuple[Rows, bool]:
        """Trace every device's update abstractly: the row layout of the updates (their
        dtypes are the inner transformation's business, e.g. fp32 updates of bf16
        parameters) and whether any device's update reads the global norm (the jaxpr uses
        its input)."""
        items, reads_norm = [], False
        for d in range(self.n):

            def updates_of(operands: _Operands, norm: jax.Array, d: int = d) -> Any:
                return self._owned_update(inner, d, operands, norm, extra_args)[0]

            jaxpr, out = jax.make_jaxpr(updates_of, return_shape=True)(
                operands, jnp.zeros((), jnp.float32)
            )
            reads_norm = reads_norm or _uses(jaxpr.jaxpr, jaxpr.jaxpr.invars[-1])
            items.append([(i, np.dtype(out[i].dtype).name, self.space.specs[i].numel) for i in out])
        return plan_rows(items), reads_norm

    def _gather_updates(
        self, update_rows: Rows, local_rows: list[jax.Array], axes: tuple[str, ...]
    ) -> list[jax.Array]:
        """Every parameter's full update, read from its owner's all-gathered row."""
        gathered = [lax.all_gather(r, axes, to="invarying") for r in local_rows]  # (N, L) each
        return [
            update_rows.unpack([g[self.owner[i]] for g in gathered], i, spec.shape)
            for i, spec in enumerate(self.space.specs)
        ]

    def _global_update(
        self,
        inner: optax.GradientTransformationExtraArgs,
        globals_: list[Any],
        params: Any,
        norm: jax.Array,
        extra_args: dict[str, Any],
        axes: tuple[str, ...],
    ) -> list[Any] | None:
        """The new global leaves (count, scheduled hyper-parameters) from an update of the
        empty tree, outside the per-device branches, so they stay replicated without a
        collective. ``None`` if the inner transformation cannot update an empty tree or its
        global leaves then differ between devices."""
        empty = self.space.param_treedef.unflatten([None] * len(self.space.specs))
        try:
            state = self._state_of_device(self.empty, [], globals_)
            _, state = inner.update(
                empty,
                state,
                None if params is None else empty,
                **extra_args,
                **global_norm_args(empty, norm),
            )
            new = self._split_state(self.empty, state)[1]
        except Exception:  # any failure: fall back to the all-gather, which always works
            return None
        if tracks_variance(axes) and any(set(axes) & varying(g) for g in new):
            return None
        return new

    # -- host side: model space <-> storage ------------------------------------------------


def build_greedy(
    inner: optax.GradientTransformation,
    space: ModelSpace,
    params: Any,
    n: int,
    cap_bytes: int,
    *,
    order: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
    matrix_owners: Mapping[int, int] | None = None,
) -> GreedyLayout:
    """Plan owners and row layouts for ``params`` (abstract) over ``n`` devices; ``order``:
    the torch registration order (torch names, after ``modules`` renames);
    ``matrix_owners``: the owners of a matrix optimizer's matrices by leaf index
    (``matrices.matrix_owner_plan``), the rest planned greedily among themselves."""
    fixed = dict(matrix_owners or {})
    # In torch registration order, not the tree's sorted order, so ties between equal sizes
    # go as in torch's ZeroRedundancyOptimizer: the same owners (docs/checkpoints.md).
    rest = [spec for i, spec in enumerate(space.specs) if i not in fixed]
    if fixed and order is not None:  # the order of the parameters greedy still plans
        kept = {torch_name(spec.name, modules=modules) for spec in rest}
        order = [name for name in order if name in kept]
    specs = registration_order(rest, order=order, modules=modules)
    plan = plan_greedy_shards(specs, world_size=n)
    if fixed:
        plan = ShardPlan(
            kind="greedy",
            world_size=n,
            shards=plan.shards
            + tuple(
                Shard(name=space.specs[i].name, rank=r, start=0, stop=space.specs[i].numel, group=0)
                for i, r in sorted(fixed.items())
            ),
        )
    rank_of = {shard.name: shard.rank for shard in plan.shards}
    owner = tuple(rank_of[spec.name] for spec in space.specs)
    owned = tuple(tuple(i for i, o in enumerate(owner) if o == d) for d in range(n))
    leaves = jax.tree.leaves(params)
    devices, state_items = [], []
    for d in range(n):
        tree = space.param_treedef.unflatten(
            [x if owner[i] == d else None for i, x in enumerate(leaves)]
        )
        device, items = map_device_state(inner, space, tree, d, owner)
        devices.append(device)
        state_items.append(items)
    empty_tree = space.param_treedef.unflatten([None] * len(space.specs))
    empty, _ = map_device_state(inner, space, empty_tree, -1, owner)
    # Gradient rows stay packed (a reduce-scatter needs one buffer per dtype anyway), with
    # each device's tensors latest-registered first.
    grads = plan_rows(
        [
            [(i, space.specs[i].dtype, space.specs[i].numel) for i in reversed(owned[d])]
            for d in range(n)
        ],
        slack=-1.0,
    )
    return GreedyLayout(
        space=space,
        n=n,
        plan=plan,
        owner=owner,
        owned=owned,
        grads=grads,
        grad_cuts=tuple(
            column_cuts(length, -(-n * length * np.dtype(dtype).itemsize // cap_bytes))
            for dtype, length in grads.buffers
        ),
        state=plan_rows(state_items),
        devices=tuple(devices),
        empty=empty,
    )
