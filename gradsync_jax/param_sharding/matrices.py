"""Muon under ``zero3_step``: each matrix stepped whole on its planned owner, the rest on rows.

``optax.contrib.muon`` orthogonalizes each matrix's momentum over the whole matrix, so no
device holding rows of a matrix can step it (docs/matrix-optimizers.md). Here every matrix
Muon orthogonalizes (its ``MuonState.mu`` leaves that are not masked) gets one owner from
``gradsync_core.plan_matrix_owners`` over the torch names and layouts (the owners torch's
``MatrixOptimizer`` and ``shard_optimizer`` pick for the same model), and one step is:

1. the other parameters (Muon's AdamW partition: embeddings, norms, biases) run the update on
   each device's rows, as any optimizer under ``zero3_step`` (``RowsUpdate``);
2. one all-to-all per dtype hands every owner each device's rows of the gradient, of the
   momentum and (where the update reads it: a weight decay) of the parameter of its
   matrices (``MatrixRowsUpdate.exchanged``: the elements the plan's
   ``rows_exchange(rank, with_params=..., state_leaves=...)`` predicts);
3. in a ``lax.switch`` branch per device, the owner puts each matrix together (padding rows
   dropped, transposed from torch's layout back to the tree's) and runs the update on its
   whole matrices: momentum and Newton-Schulz as one unsharded ``tx.update``;
4. a second all-to-all hands every device back its rows of the update and of the new momentum.

The optimizer state stays sharded flat like the rest (each device its rows of every
momentum, the state ``tx.init`` makes on the chunks): the same tree, specs and checkpoint as
any ``zero3_step`` optimizer, 1/N per device. The price is the momentum's rows travelling to
the owner and back with the gradient (2 inbound, 3 with a weight decay, and 2 outbound
tensors per matrix, where torch's owner keeps the momentum and moves 2 and 1).

What makes it exact is proven from the update's jaxpr before the step is built
(``zero/soundness.py``): every output reads only its own tensor and the global leaves (no
global-norm clip chained with Muon), the update of one owner's matrices alone is computed as
on the whole tree, and the rest is exact on rows; anything else is refused with one sentence.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

from gradsync_core import MatrixOwnerPlan, OwnerExchange, ParamSpec, chunk_rows, plan_matrix_owners
from gradsync_jax._axes import cast_varying
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout
from gradsync_jax.param_sharding.update import RowsUpdate, refusal, rows_tree
from gradsync_jax.zero.matrices import keeps_muon_state, muon_matrices
from gradsync_jax.zero.model_space import model_space
from gradsync_jax.zero.rows import DeviceState, map_device_state
from gradsync_jax.zero.soundness import Soundness

Key = tuple[str, int]  # ("grad" | "param" | "update", parameter) or ("state", state leaf)


class _Slot(NamedTuple):
    """One tensor's chunk in a row of an all-to-all buffer."""

    key: Key
    matrix: int  # trainable leaf index
    offset: int
    numel: int  # elements of one chunk (padding rows included)


@dataclass(frozen=True, slots=True)
class _Buffers:
    """All-to-all buffers, one per dtype: ``rows[dtype][r]`` lays out row ``r``."""

    rows: dict[str, tuple[tuple[_Slot, ...], ...]]
    length: dict[str, int]


def _buffers(per_row: list[list[tuple[Key, int, str, int]]]) -> _Buffers:
    """Lay out ``per_row[r]``: (key, matrix, dtype, chunk numel) in order, per dtype."""
    dtypes = sorted({dtype for row in per_row for _, _, dtype, _ in row})
    rows: dict[str, tuple[tuple[_Slot, ...], ...]] = {}
    length: dict[str, int] = {}
    for dtype in dtypes:
        laid = []
        for row in per_row:
            slots, offset = [], 0
            for key, matrix, dt, numel in row:
                if dt == dtype:
                    slots.append(_Slot(key, matrix, offset, numel))
                    offset += numel
            laid.append(tuple(slots))
        rows[dtype] = tuple(laid)
        length[dtype] = max(sum(s.numel for s in row) for row in laid)
    return _Buffers(rows, length)


class _Owners(NamedTuple):
    """What ``Soundness.greedy_problem`` reads of a layout: each program's parameters and
    how its state maps onto the whole tree's."""

    owned: tuple[tuple[int, ...], ...]
    devices: tuple[DeviceState, ...]


class MatrixRowsUpdate:
    """``tx.update`` of a Muon under ``zero3_step`` (module doc), with ``RowsUpdate``'s
    interface: ``init(params, axes)`` and ``update(grads, state, params, axes)`` inside
    ``shard_map``, on the chunk trees of the trainable parameters.

    Attributes:
        plan: the ``MatrixOwnerPlan`` (torch names and layouts, ``cost="newton_schulz"``).
        rows: the ``RowsUpdate`` of the other parameters.

    Raises:
        ValueError: (at construction) an update that is not exact this way: one sentence.
    """

    def __init__(self, tx: optax.GradientTransformationExtraArgs, layout: ParamLayout) -> None:
        self.tx, self.layout = tx, layout
        trainable = [leaf for leaf in layout.leaves if leaf.trainable]
        self.trainable = trainable
        n = layout.world_size
        self.n = n
        flax_whole = _tree(layout, lambda leaf: leaf.shape)
        torch_whole = rows_tree(layout, lambda leaf: leaf.rows)
        try:
            matrices = muon_matrices(tx, model_space(tx, flax_whole), flax_whole)
            on_rows = muon_matrices(tx, model_space(tx, torch_whole), torch_whole)
        except Exception as err:  # what cannot be analysed is refused
            raise refusal(f"its state cannot be analysed ({type(err).__name__})") from err
        if not matrices or matrices != on_rows:
            raise refusal(
                "it keeps a Muon's momentum, but the matrices it orthogonalizes could not be "
                "told from its state the same way in torch's layout as in the tree's (a label "
                "or dimension number chosen by shape)"
            )
        flat = [i for i in matrices if len(trainable[i].shape) < 2]
        if flat:
            leaf = trainable[flat[0]]
            raise refusal(
                f"it keeps a Muon momentum for {leaf.flax_name!r} of shape {leaf.shape}, which "
                "is not a matrix (give such parameters to Muon's AdamW partition)"
            )
        self.matrices = tuple(matrices)
        is_matrix = set(matrices)
        specs = [
            ParamSpec(
                name=trainable[i].name, shape=trainable[i].torch_shape, dtype=trainable[i].dtype
            )
            for i in matrices
        ]
        self.plan: MatrixOwnerPlan = plan_matrix_owners(specs, world_size=n, cost="newton_schulz")
        self.owner = {
            i: self.plan.owner(spec.name) for i, spec in zip(matrices, specs, strict=True)
        }
        self.owned = tuple(tuple(i for i in matrices if self.owner[i] == d) for d in range(n))

        # The analysis tree: matrices in the tree's layout (Muon's update reads it: its
        # fan_in/fan_out scale, its dimension numbers), the rest in torch's (on rows).
        mixed = _tree(
            layout, lambda leaf: leaf.shape if self._index(leaf) in is_matrix else leaf.torch_shape
        )
        space = model_space(tx, mixed)
        self.space = space
        soundness = Soundness(tx, space, mixed, {}, totals=False)
        if reason := soundness.coupled_reason():
            raise refusal(
                f"its {reason}, and with Muon's matrices stepped on their owners nothing "
                "completes a reduction across parameters"
            )
        specs_mixed = jax.tree.leaves(mixed)
        owner_of = [self.owner.get(i, n) for i in range(len(trainable))]  # n: the rows
        programs = [*self.owned, tuple(i for i in range(len(trainable)) if i not in is_matrix)]
        devices = []
        for d, members in enumerate(programs):
            tree = space.param_treedef.unflatten(
                [s if i in members else None for i, s in enumerate(specs_mixed)]
            )
            devices.append(map_device_state(tx, space, tree, d, owner_of)[0])
        self.devices, self.rest = tuple(devices[:n]), devices[n]
        problem = soundness.greedy_problem(cast(Any, _Owners(tuple(programs), tuple(devices))))
        if problem:
            what = problem.split("computes the ")[-1].split(" differently")[0]
            raise refusal(
                f"given one owner's matrices alone it computes the {what} differently than on "
                "the whole tree"
            )
        # Each matrix's per-parameter state leaves, which must be shaped like it (rows).
        self.state_of: dict[int, tuple[int, ...]] = {
            i: tuple(k for k, s in enumerate(space.leaves) if s.param == i) for i in matrices
        }
        for i, ks in self.state_of.items():
            for k in ks:
                if space.leaves[k].shape != trainable[i].shape:
                    raise refusal(
                        f"its state leaf {space.leaves[k].name!r} is not shaped like its "
                        "matrix, so it cannot be kept in the matrix's rows"
                    )
        local = rows_tree(layout, lambda leaf: leaf.padded_rows)
        if reason := _init_problem(tx, torch_whole, local):
            raise refusal(f"its init {reason}")
        rest_layout = dataclasses.replace(
            layout,
            leaves=tuple(
                dataclasses.replace(leaf, trainable=False)
                if leaf.trainable and self._index(leaf) in is_matrix
                else leaf
                for leaf in layout.leaves
            ),
        )
        self.rows = RowsUpdate(tx, rest_layout)

        # What travels. The owner's update reads the parameters only if its jaxpr says so.
        whole = [trainable[i] for i in range(len(trainable))]
        state_dtype = {k: space.leaves[k].dtype for ks in self.state_of.values() for k in ks}
        self.with_params = self._reads_params(tx, space, specs_mixed)
        out_dtypes = self._update_dtypes(tx, space, specs_mixed)

        def inbound(i: int) -> list[tuple[Key, int, str, int]]:
            numel = whole[i].padded_rows * _row_numel(whole[i])
            keys: list[tuple[Key, str]] = [(("grad", i), whole[i].dtype)]
            keys += [(("state", k), state_dtype[k]) for k in self.state_of[i]]
            if self.with_params:
                keys.append((("param", i), whole[i].dtype))
            return [(key, i, dtype, numel) for key, dtype in keys]

        def outbound(i: int) -> list[tuple[Key, int, str, int]]:
            numel = whole[i].padded_rows * _row_numel(whole[i])
            keys: list[tuple[Key, str]] = [(("update", i), out_dtypes[i])]
            keys += [(("state", k), state_dtype[k]) for k in self.state_of[i]]
            return [(key, i, dtype, numel) for key, dtype in keys]

        # Gather: row r of every device's buffer is its rows of r's matrices. Scatter: the
        # owner's row s is device s's rows of its matrices (every device's chunk is alike).
        self.gather_buffers = _buffers(
            [[x for i in self.owned[r] for x in inbound(i)] for r in range(n)]
        )
        self.scatter_buffers = _buffers(
            [[x for i in self.owned[r] for x in outbound(i)] for r in range(n)]
        )

    def _index(self, leaf: LeafLayout) -> int:
        return next(k for k, t in enumerate(self.trainable) if t is leaf)

    @staticmethod
    def _reads_params(tx: Any, space: Any, specs: list[Any]) -> bool:
        """Whether the update reads the parameters (Muon's weight decay, when not 0)."""

        def update_of(grads: list[Any], params: list[Any]) -> Any:
            g, p = space.param_treedef.unflatten(grads), space.param_treedef.unflatten(params)
            return tx.update(g, tx.init(g), p)

        closed = jax.make_jaxpr(update_of)(specs, specs)
        params_in = closed.jaxpr.invars[len(specs) :]
        return any(_reads(closed.jaxpr, v) for v in params_in)

    @staticmethod
    def _update_dtypes(tx: Any, space: Any, specs: list[Any]) -> list[str]:
        tree = space.param_treedef.unflatten(specs)
        out = jax.eval_shape(lambda t: tx.update(t, tx.init(t), t)[0], tree)
        return [np.dtype(u.dtype).name for u in space.param_treedef.flatten_up_to(out)]

    # -- inside shard_map ------------------------------------------------------------------

    def init(self, params: Any, axes: tuple[str, ...]) -> Any:
        """The optimizer state of this device's rows: ``tx.init`` on the chunks (proven
        elementwise at construction)."""
        del axes
        return self.tx.init(params)

    def __call__(
        self, grads: Any, state: Any, params: Any, axes: tuple[str, ...]
    ) -> tuple[Any, Any]:
        """The updates and the new state of this device's rows (module doc)."""
        treedef = self.space.param_treedef
        g = treedef.flatten_up_to(grads)
        p = treedef.flatten_up_to(params)
        s = jax.tree.leaves(state)
        state_def = jax.tree.structure(state)
        new_s: list[Any] = list(s)
        # 1. The rest on rows.
        rest_tree = lambda leaves: treedef.unflatten(  # noqa: E731
            [x if i not in self.owner else None for i, x in enumerate(leaves)]
        )
        rest_state = self.rest.treedef.unflatten([s[k] for _, k in self.rest.sources])
        u_rest, rest_state = self.rows(rest_tree(g), rest_state, rest_tree(p), axes)
        u = list(treedef.flatten_up_to(u_rest))
        for (_, k), leaf in zip(self.rest.sources, jax.tree.leaves(rest_state), strict=True):
            new_s[k] = leaf  # the global leaves too: they read no tensor (proven)
        # 2. Every owner gets its matrices' rows.
        values: dict[Key, Any] = {}
        for i in self.matrices:
            values[("grad", i)] = g[i]
            values[("param", i)] = p[i]
            for k in self.state_of[i]:
                values[("state", k)] = s[k]
        sent = self._pack(self.gather_buffers, lambda r, slot: values[slot.key])
        received = {t: lax.all_to_all(b, axes, 0, 0, tiled=True) for t, b in sent.items()}
        globals_ = [s[k] for k, leaf in enumerate(self.space.leaves) if leaf.param is None]

        # 3. Each owner steps its matrices whole.
        def branch(d: int) -> Callable[[Any], Any]:
            def run(operands: Any) -> Any:
                recv, glob = operands
                whole = self._unpack_whole(d, recv)
                out = self._owner_step(d, whole, glob)
                return cast_varying(self._pack_scatter(d, out), axes)

            return run

        me = lax.axis_index(axes)
        back = lax.switch(me, [branch(d) for d in range(self.n)], (received, globals_))
        # 4. Every device gets its rows back.
        returned = {t: lax.all_to_all(b, axes, 0, 0, tiled=True) for t, b in back.items()}
        for t, rows in self.scatter_buffers.rows.items():
            for r, row in enumerate(rows):
                for slot in row:
                    leaf = self.trainable[slot.matrix]
                    chunk = returned[t][r, slot.offset : slot.offset + slot.numel]
                    chunk = chunk.reshape(leaf.local_shape)
                    kind, index = slot.key
                    if kind == "update":
                        u[index] = chunk
                    else:
                        new_s[index] = chunk
        return treedef.unflatten(u), jax.tree.unflatten(state_def, new_s)

    def _pack(self, buffers: _Buffers, value: Callable[[int, _Slot], Any]) -> dict[str, Any]:
        """Each dtype's ``(N, L)`` buffer, row ``r`` from ``value(r, slot)`` (1-D chunks)."""
        out = {}
        for t, rows in buffers.rows.items():
            length = buffers.length[t]
            packed = []
            for r, row in enumerate(rows):
                parts = [jnp.ravel(value(r, slot)).astype(t) for slot in row]
                used = sum(slot.numel for slot in row)
                if length > used:
                    parts.append(jnp.zeros(length - used, t))
                packed.append(jnp.concatenate(parts) if parts else jnp.zeros(length, t))
            out[t] = jnp.stack(packed)
        return out

    def _unpack_whole(self, d: int, recv: dict[str, Any]) -> dict[Key, Any]:
        """Owner ``d``'s whole tensors in the tree's layout, from every device's rows."""
        out: dict[Key, Any] = {}
        for t, rows in self.gather_buffers.rows.items():
            for slot in rows[d]:
                leaf = self.trainable[slot.matrix]
                chunks = recv[t][:, slot.offset : slot.offset + slot.numel]
                torch_whole = chunks.reshape(self.n * leaf.padded_rows, *leaf.torch_shape[1:])
                out[slot.key] = torch_whole[: leaf.rows].transpose(leaf.inverse_perm)
        return out

    def _owner_step(self, d: int, whole: dict[Key, Any], globals_: list[Any]) -> dict[Key, Any]:
        """``tx.update`` on owner ``d``'s whole matrices: updates and new state by key."""
        owned = set(self.owned[d])
        treedef = self.space.param_treedef
        size = len(self.trainable)
        g = treedef.unflatten([whole[("grad", i)] if i in owned else None for i in range(size)])
        if self.with_params:
            p = treedef.unflatten(
                [whole[("param", i)] if i in owned else None for i in range(size)]
            )
        else:  # not read (checked): zeros of its shapes
            p = jax.tree.map(jnp.zeros_like, g)
        device = self.devices[d]
        by_global = dict(
            zip(
                [k for k, leaf in enumerate(self.space.leaves) if leaf.param is None],
                globals_,
                strict=True,
            )
        )
        state = device.treedef.unflatten(
            [
                by_global[k] if kind == "global" else whole[("state", k)]
                for kind, k in device.sources
            ]
        )
        u, state = self.tx.update(g, state, p)
        u_leaves = treedef.flatten_up_to(u)
        out: dict[Key, Any] = {("update", i): u_leaves[i] for i in owned}
        for (kind, k), leaf in zip(device.sources, jax.tree.leaves(state), strict=True):
            if kind != "global":
                out[("state", k)] = leaf
        return out

    def _pack_scatter(self, d: int, out: dict[Key, Any]) -> dict[str, Any]:
        """Owner ``d``'s scatter buffers: row ``s`` is device ``s``'s rows of its tensors."""
        pieces: dict[Key, Any] = {}
        for rows in self.scatter_buffers.rows.values():
            for slot in rows[d]:
                leaf = self.trainable[slot.matrix]
                torch_whole = out[slot.key].transpose(leaf.perm)
                pad = self.n * leaf.padded_rows - leaf.rows
                padded = jnp.pad(torch_whole, [(0, pad)] + [(0, 0)] * (torch_whole.ndim - 1))
                pieces[slot.key] = padded.reshape(self.n, -1)
        # Every device's row of the owner's buffer; the branches of other owners pack zeros.
        buffers: dict[str, Any] = {}
        for t, rows in self.scatter_buffers.rows.items():
            length = self.scatter_buffers.length[t]
            parts = [pieces[slot.key].astype(t) for slot in rows[d]]
            used = sum(slot.numel for slot in rows[d])
            if length > used:
                parts.append(jnp.zeros((self.n, length - used), t))
            buffers[t] = jnp.concatenate(parts, axis=1) if parts else jnp.zeros((self.n, length), t)
        return buffers

    # -- what moves ------------------------------------------------------------------------

    def exchanged(self, rank: int) -> OwnerExchange:
        """The elements of real rows (no padding) ``rank`` sends and receives in one step,
        counted from the buffers' layout (what ``plan.rows_exchange`` predicts)."""
        sent = received = 0
        for buffers, outward in ((self.gather_buffers, False), (self.scatter_buffers, True)):
            for rows in buffers.rows.values():
                for owner, row in enumerate(rows):
                    for slot in row:
                        leaf = self.trainable[slot.matrix]
                        held = [_held(leaf, self.n, r) for r in range(self.n)]
                        if outward:  # the owner sends every other device its rows
                            if owner == rank:
                                sent += sum(held) - held[rank]
                            else:
                                received += held[rank]
                        elif owner == rank:
                            received += sum(held) - held[rank]
                        else:
                            sent += held[rank]
        return OwnerExchange(sent_numel=sent, received_numel=received)

    def wire_numel(self) -> OwnerExchange:
        """The elements each device's two all-to-alls move to the others, padding included
        (every buffer row is as long as the longest owner's)."""
        total = sum((self.n - 1) * length for length in self.gather_buffers.length.values())
        total += sum((self.n - 1) * length for length in self.scatter_buffers.length.values())
        return OwnerExchange(sent_numel=total, received_numel=total)


def _tree(layout: ParamLayout, shape: Callable[[LeafLayout], tuple[int, ...]]) -> Any:
    """The trainable parameters as ``ShapeDtypeStruct``s of ``shape(leaf)`` (frozen: None)."""
    return jax.tree_util.tree_unflatten(
        layout.treedef,
        [
            jax.ShapeDtypeStruct(shape(leaf), np.dtype(leaf.dtype)) if leaf.trainable else None
            for leaf in layout.leaves
        ],
    )


def _row_numel(leaf: LeafLayout) -> int:
    return int(np.prod(leaf.torch_shape[1:], dtype=np.int64))


def _held(leaf: LeafLayout, n: int, rank: int) -> int:
    """Elements of real rows ``rank`` holds of ``leaf``."""
    start, stop, _ = chunk_rows(leaf.rows, n, rank)
    return (stop - start) * _row_numel(leaf)


def _reads(jaxpr: Any, var: Any) -> bool:
    """Whether ``jaxpr`` reads ``var`` (an equation's input or an output)."""
    return any(v is var for eqn in jaxpr.eqns for v in eqn.invars) or any(
        v is var for v in jaxpr.outvars
    )


def _init_problem(tx: Any, whole: Any, local: Any) -> str | None:
    """Why ``tx.init`` run as it is on each device's rows is not the rows of its init on the
    whole tensors, or None: each per-parameter leaf elementwise in its own tensor and computed
    alike, each global leaf (``count``, Muon's ``ns_coeffs`` constant) reading no tensor."""
    space = model_space(tx, whole)
    check = Soundness(tx, space, whole, {}, totals=False)
    expected, got = check._init_trace(whole), check._init_trace(local)
    for k, node in enumerate(got):
        own = space.leaves[k].param
        what = f"initial state leaf {space.leaves[k].name!r}"
        if own is None:
            if node.deps:
                return f"computes the {what}, shared by all parameters, from their values"
            continue
        if reason := check._flat_reason(node, own, expected[k], what, "a device's rows"):
            return reason
    return None


def rows_update(tx: optax.GradientTransformationExtraArgs, layout: ParamLayout) -> Any:
    """The update ``zero3_step`` runs: ``MatrixRowsUpdate`` for a transformation that keeps a
    ``MuonState`` on these parameters, else ``RowsUpdate`` (each refuses what it cannot run
    exactly)."""
    whole = rows_tree(layout, lambda leaf: leaf.rows)
    if keeps_muon_state(tx, whole):
        return MatrixRowsUpdate(tx, layout)
    return RowsUpdate(tx, layout)
