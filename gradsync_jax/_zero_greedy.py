"""Greedy partition: each device owns whole parameters (ZeRO-1, DESIGN §4).

Owners come from ``gradsync_core.plan_greedy_shards`` (torch's ``ZeroRedundancyOptimizer``
rule), so a torch job with the same parameter list picks the same owners. Device ``d`` runs
the inner transformation on the whole tensors it owns, so any Optax optimizer works, Adafactor
included. The devices own different trees, so the update branches on ``lax.axis_index``
(``lax.switch``: each device executes only its own branch) and its per-parameter state lives
in one packed row per dtype: a ``(N, L)`` buffer sharded ``P(axis)``, ``L`` the largest
device's share.

One step: gradients packed by owner and reduce-scattered (each device receives the summed
gradients of the tensors it owns), the inner update on them, then one all-gather of the
packed updates; the same bytes on the wire as one all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradsync_core import ShardPlan, plan_greedy_shards
from gradsync_jax._sync import _tracks_variance, _varying
from gradsync_jax._zero_clip import shard_context
from gradsync_jax._zero_space import ModelSpace, path_parts, reduce_scatter

Slot = tuple[str, int]  # (dtype name, offset in the owner's row)


def _pack(rows: list[dict[str, list[jax.Array]]], lengths: dict[str, int]) -> dict[str, jax.Array]:
    """Per dtype, a (len(rows), L) array: row d = concatenation of rows[d][dtype], zero-padded."""
    out = {}
    for dtype, length in lengths.items():
        pieces = []
        for row in rows:
            parts = [x.ravel() for x in row.get(dtype, [])]
            used = sum(int(p.size) for p in parts)
            if length > used:
                parts.append(jnp.zeros(length - used, dtype))
            pieces.extend(parts)
        out[dtype] = jnp.concatenate(pieces).reshape(len(rows), length)
    return out


def _vary(tree: Any, axes: tuple[str, ...]) -> Any:
    """Mark every leaf varying over ``axes``: ``lax.switch`` needs equal output types, and a
    device that owns nothing returns constants where the others return varying values."""
    if not _tracks_variance(axes):
        return tree

    def cast(x: Any) -> Any:
        missing = tuple(a for a in axes if a not in _varying(x))
        return lax.pcast(x, missing, to="varying") if missing else x

    return jax.tree.map(cast, tree)


def _unpack(
    rows: dict[str, jax.Array], slot: Slot, shape: tuple[int, ...], dtype: str
) -> jax.Array:
    """The tensor at ``slot`` of a packed row (zero-size tensors have no row at all)."""
    numel = int(np.prod(shape, dtype=np.int64))
    if numel == 0:
        return jnp.zeros(shape, dtype)
    offset = slot[1]
    return rows[slot[0]][offset : offset + numel].reshape(shape)


def _slots(items: list[tuple[int, str, int]]) -> tuple[dict[int, Slot], dict[str, int]]:
    """(key, dtype, numel) in order -> each key's (dtype, offset) and the row length per dtype."""
    offsets: dict[str, int] = {}
    slots = {}
    for key, dtype, numel in items:
        slots[key] = (dtype, offsets.get(dtype, 0))
        offsets[dtype] = offsets.get(dtype, 0) + numel
    return slots, offsets


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceState:
    """How device ``d``'s inner state (``inner.init`` of its owned tree) maps to storage."""

    treedef: Any
    sources: tuple[tuple[str, int], ...]  # per leaf: ("global" | "param", space index)


@dataclass(frozen=True, slots=True, kw_only=True)
class GreedyLayout:
    space: ModelSpace
    n: int
    plan: ShardPlan
    owner: tuple[int, ...]  # per parameter leaf
    owned: tuple[tuple[int, ...], ...]  # per device: its parameter leaves, in tree order
    grad_slots: dict[int, Slot]  # parameter leaf -> slot in its owner's gradient row
    grad_len: dict[str, int]
    state_slots: dict[int, Slot]  # per-parameter state leaf (space index) -> slot
    state_len: dict[str, int]
    devices: tuple[DeviceState, ...]
    empty: DeviceState  # the state of a device that owns nothing: global leaves only

    @property
    def partition(self) -> str:
        return "greedy"

    def state_specs(self, spec: Any) -> tuple[Any, dict[str, Any]]:
        """(inner spec tree, shards spec dict): globals replicated, per-parameter leaves None."""
        inner = self.space.state_treedef.unflatten(
            [jax.sharding.PartitionSpec() if s.param is None else None for s in self.space.leaves]
        )
        return inner, {dtype: jax.sharding.PartitionSpec(spec) for dtype in self.state_len}

    def nbytes_per_device(self) -> int:
        globals_ = sum(
            s.numel * np.dtype(s.dtype).itemsize for s in self.space.leaves if s.param is None
        )
        return globals_ + sum(n * np.dtype(d).itemsize for d, n in self.state_len.items())

    def _inner(self, global_values: list[Any]) -> Any:
        it = iter(global_values)
        return self.space.state_treedef.unflatten(
            [next(it) if s.param is None else None for s in self.space.leaves]
        )

    def _owned_tree(self, d: int, leaves: list[Any] | None) -> Any:
        if leaves is None:
            return None
        owned = set(self.owned[d])
        return self.space.param_treedef.unflatten(
            [leaf if i in owned else None for i, leaf in enumerate(leaves)]
        )

    def _split_state(
        self, device: DeviceState, state: Any
    ) -> tuple[dict[str, list[Any]], list[Any]]:
        """A device's inner state -> (row pieces per dtype, global values in space order)."""
        leaves = device.treedef.flatten_up_to(state)
        rows: dict[str, list[Any]] = {}
        globals_: dict[int, Any] = {}
        for (kind, index), leaf in zip(device.sources, leaves, strict=True):
            if kind == "global":
                globals_[index] = jnp.asarray(leaf).astype(self.space.leaves[index].dtype)
            else:
                rows.setdefault(self.state_slots[index][0], []).append(leaf)
        order = [i for i, s in enumerate(self.space.leaves) if s.param is None]
        return rows, [globals_[i] for i in order]

    def _device_state(
        self, device: DeviceState, rows: dict[str, jax.Array], globals_: list[Any]
    ) -> Any:
        by_index = dict(
            zip(
                [i for i, s in enumerate(self.space.leaves) if s.param is None],
                globals_,
                strict=True,
            )
        )
        leaves = []
        for kind, index in device.sources:
            leaf = self.space.leaves[index]
            if kind == "global":
                leaves.append(by_index[index])
            else:
                leaves.append(_unpack(rows, self.state_slots[index], leaf.shape, leaf.dtype))
        return device.treedef.unflatten(leaves)

    # -- inside shard_map ------------------------------------------------------------------

    def init_local(self, inner: optax.GradientTransformation, params: list[Any], axes: Any) -> Any:
        def branch(d: int) -> Any:
            def run(params: list[Any]) -> Any:
                rows, globals_ = self._split_state(
                    self.devices[d], inner.init(self._owned_tree(d, params))
                )
                return _vary((_pack([rows], self.state_len), globals_), axes)

            return run

        rows, globals_ = lax.switch(
            lax.axis_index(axes), [branch(d) for d in range(self.n)], params
        )
        # Every device computes the same global leaves (count, hyper-parameters); the switch
        # makes them device-varying, so take device 0's to return them replicated.
        globals_ = [lax.all_gather(g, axes, to="invarying")[0] for g in globals_]
        return self._inner(globals_), rows

    def update_local(
        self,
        inner: optax.GradientTransformationExtraArgs,
        grads: list[jax.Array],
        inner_state: Any,
        shards: dict[str, jax.Array],
        params: list[Any] | None,
        extra_args: dict[str, Any],
        axes: Any,
        mean: bool,
    ) -> tuple[list[jax.Array], Any, dict[str, jax.Array]]:
        specs = self.space.specs
        by_owner: list[dict[str, list[jax.Array]]] = [{} for _ in range(self.n)]
        for d in range(self.n):
            for i in self.owned[d]:
                by_owner[d].setdefault(self.grad_slots[i][0], []).append(grads[i])
        packed = _pack(by_owner, self.grad_len)
        reduced = {}
        for dtype, buf in packed.items():
            reduced[dtype] = reduce_scatter(buf, axes, self.n, mean)[0]
        squares = [jnp.sum(jnp.square(r)) for r in reduced.values()]
        norm = jnp.sqrt(lax.psum(sum(squares) if squares else jnp.zeros(()), axes))
        globals_ = list(jax.tree.leaves(inner_state))  # exactly the global leaves, in order
        rows = {dtype: buf[0] for dtype, buf in shards.items()}

        def owned_update(d: int, reduced: Any, rows: Any, globals_: Any, params: Any) -> Any:
            leaves: list[Any] = [None] * len(specs)
            for i in self.owned[d]:
                leaves[i] = _unpack(reduced, self.grad_slots[i], specs[i].shape, specs[i].dtype)
            g_tree = self.space.param_treedef.unflatten(leaves)
            state = self._device_state(self.devices[d], rows, globals_)
            with shard_context(g_tree, norm):
                u_tree, state = inner.update(
                    g_tree, state, self._owned_tree(d, params), **extra_args
                )
            u_leaves = self.space.param_treedef.flatten_up_to(u_tree)
            return [u_leaves[i] for i in self.owned[d]], state

        # The updates' dtypes are the inner transformation's business (e.g. fp32 updates of
        # bf16 parameters); read them from an abstract run before packing.
        operands = (reduced, rows, globals_, params)
        upd_items = []
        for d in range(self.n):
            shapes = jax.eval_shape(lambda *ops, d=d: owned_update(d, *ops)[0], *operands)
            upd_items += [
                (i, np.dtype(s.dtype).name, specs[i].numel)
                for i, s in zip(self.owned[d], shapes, strict=True)
            ]
        upd_slots: dict[int, Slot] = {}
        upd_len: dict[str, int] = {}
        for d in range(self.n):
            slots, lengths = _slots([t for t in upd_items if t[0] in set(self.owned[d])])
            upd_slots.update(slots)
            for dtype, length in lengths.items():
                upd_len[dtype] = max(upd_len.get(dtype, 0), length)

        def branch(d: int) -> Any:
            def run(reduced: Any, rows: Any, globals_: Any, params: Any) -> Any:
                u_leaves, state = owned_update(d, reduced, rows, globals_, params)
                u_rows: dict[str, list[Any]] = {}
                for i, u in zip(self.owned[d], u_leaves, strict=True):
                    u_rows.setdefault(upd_slots[i][0], []).append(u)
                s_rows, new_globals = self._split_state(self.devices[d], state)
                u_packed = {k: v[0] for k, v in _pack([u_rows], upd_len).items()}
                return _vary((u_packed, _pack([s_rows], self.state_len), new_globals), axes)

            return run

        u_rows, s_rows, new_globals = lax.switch(
            lax.axis_index(axes), [branch(d) for d in range(self.n)], *operands
        )
        gathered = {k: lax.all_gather(v, axes, to="invarying") for k, v in u_rows.items()}
        updates = []
        for i, spec in enumerate(specs):
            dtype = upd_slots[i][0]
            rows_i = {dtype: gathered[dtype][self.owner[i]]} if dtype in gathered else {}
            updates.append(_unpack(rows_i, upd_slots[i], spec.shape, dtype))
        outside = self._global_update(inner, globals_, params, norm, extra_args, axes)
        if outside is None:  # device 0's values, replicated by a (tiny) all-gather
            outside = [lax.all_gather(g, axes, to="invarying")[0] for g in new_globals]
        return updates, self._inner(outside), s_rows

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
            state = self._device_state(self.empty, {}, globals_)
            with shard_context(empty, norm):
                _, state = inner.update(
                    empty, state, None if params is None else empty, **extra_args
                )
            _, new = self._split_state(self.empty, state)
        except Exception:  # any failure: fall back to the all-gather, which always works
            return None
        if _tracks_variance(axes) and any(set(axes) & _varying(g) for g in new):
            return None
        return new

    # -- host side: model space <-> storage ------------------------------------------------

    def gather(self, inner_state: Any, shards: dict[str, Any]) -> list[np.ndarray]:
        """The unsharded inner state's leaves (NumPy), in ``space.leaves`` order."""
        host = {dtype: np.asarray(buf) for dtype, buf in shards.items()}
        globals_ = iter(np.asarray(g) for g in jax.tree.leaves(inner_state))
        out = []
        for index, leaf in enumerate(self.space.leaves):
            if leaf.param is None:
                out.append(next(globals_))
            elif leaf.numel == 0:  # zero-size tensors have no row at all
                out.append(np.zeros(leaf.shape, leaf.dtype))
            else:
                dtype, offset = self.state_slots[index]
                row = host[dtype][self.owner[leaf.param]]
                out.append(row[offset : offset + leaf.numel].reshape(leaf.shape))
        return out

    def scatter(self, leaves: list[np.ndarray]) -> tuple[Any, dict[str, np.ndarray]]:
        """Unsharded leaves -> (inner with globals, host shard buffers)."""
        host = {dtype: np.zeros((self.n, n), dtype) for dtype, n in self.state_len.items()}
        for index, (leaf, value) in enumerate(zip(self.space.leaves, leaves, strict=True)):
            if leaf.param is not None and leaf.numel:
                dtype, offset = self.state_slots[index]
                host[dtype][self.owner[leaf.param], offset : offset + leaf.numel] = np.ravel(value)
        globals_ = [v for s, v in zip(self.space.leaves, leaves, strict=True) if s.param is None]
        return self._inner(globals_), host


def build_greedy(
    inner: optax.GradientTransformation, space: ModelSpace, params: Any, n: int
) -> GreedyLayout:
    """Plan owners and pack layouts for ``params`` (abstract) over ``n`` devices."""
    plan = plan_greedy_shards(list(space.specs), world_size=n)
    rank_of = {shard.name: shard.rank for shard in plan.shards}
    owner = tuple(rank_of[spec.name] for spec in space.specs)
    owned = tuple(tuple(i for i, o in enumerate(owner) if o == d) for d in range(n))
    grad_slots: dict[int, Slot] = {}
    grad_len: dict[str, int] = {}
    state_slots: dict[int, Slot] = {}
    state_len: dict[str, int] = {}
    devices = []
    leaves = jax.tree.leaves(params)
    for d in range(n):
        slots, lengths = _slots([(i, space.specs[i].dtype, space.specs[i].numel) for i in owned[d]])
        grad_slots.update(slots)
        for dtype, length in lengths.items():
            grad_len[dtype] = max(grad_len.get(dtype, 0), length)
        tree = space.param_treedef.unflatten(
            [leaf if owner[i] == d else None for i, leaf in enumerate(leaves)]
        )
        device_state = jax.eval_shape(inner.init, tree)
        flat, treedef = jax.tree_util.tree_flatten_with_path(device_state)
        sources = []
        items = []
        for path, leaf in flat:
            joined = "/".join(path_parts(path))
            if joined in space.global_by_path:
                sources.append(("global", space.global_by_path[joined]))
                continue
            index = space.param_by_path.get(joined)
            known = None if index is None else space.leaves[index]
            if known is None or owner[known.param] != d or known.shape != tuple(leaf.shape):
                raise ValueError(
                    f"inner optimizer state leaf {joined!r} of device {d}'s share does not "
                    "match the unsharded state; the inner transformation's state must be laid "
                    "out per parameter"
                )
            sources.append(("param", index))
            items.append((index, np.dtype(leaf.dtype).name, known.numel))
        slots, lengths = _slots(items)
        state_slots.update(slots)
        for dtype, length in lengths.items():
            state_len[dtype] = max(state_len.get(dtype, 0), length)
        devices.append(DeviceState(treedef=treedef, sources=tuple(sources)))
    empty_tree = space.param_treedef.unflatten([None] * len(space.specs))
    flat, treedef = jax.tree_util.tree_flatten_with_path(jax.eval_shape(inner.init, empty_tree))
    empty = DeviceState(
        treedef=treedef,
        sources=tuple(("global", space.global_by_path["/".join(path_parts(p))]) for p, _ in flat),
    )
    return GreedyLayout(
        space=space,
        empty=empty,
        n=n,
        plan=plan,
        owner=owner,
        owned=owned,
        grad_slots=grad_slots,
        grad_len={k: v for k, v in grad_len.items() if v},
        state_slots=state_slots,
        state_len={k: v for k, v in state_len.items() if v},
        devices=tuple(devices),
    )
