"""The optimizer's update on each device's rows, with whole-tensor reductions made whole.

``zero3_step`` runs the Optax update on each device's chunk of every parameter: its rows of
dim 0 in torch's layout, zero padded (placement.py). An elementwise update (SGD, Adam, AdamW,
Lion) needs nothing more. A reduction over a whole tensor (the sums of squares of
``clip_by_global_norm``'s global norm, LAMB's and LARS's trust ratios, ``apply_if_finite``'s
finite test) would see the device's rows only: here each one is completed across the devices,
its padding rows masked out first, so the update equals the unsharded one (up to the order of
the sums). The reductions that are ready together travel in one all-reduce of a small vector
(a global norm's per-leaf sums: one collective, as ``shard_optimizer``'s ``global_norm``).

Which reductions those are, and that nothing else reads across the elements of a tensor or
across tensors, is proven from the update's jaxpr (zero/analysis.py, ``totals``): on abstract
rows when the step is built (``RowsUpdate``, which refuses the rest with one sentence), and
again on the update traced inside ``shard_map``, whose equations are then bound one by one
with the reductions completed.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.extend import core as jcore

from gradsync_jax._axes import cast_varying, varying
from gradsync_jax.param_sharding.layout import LeafLayout, ParamLayout
from gradsync_jax.zero.analysis import Analyser, Role, call_jaxpr
from gradsync_jax.zero.model_space import model_space
from gradsync_jax.zero.soundness import Soundness


def rows_tree(layout: ParamLayout, rows: Callable[[LeafLayout], int]) -> Any:
    """The trainable parameters as ``ShapeDtypeStruct``s in torch's layout with ``rows(leaf)``
    rows (``None`` where a leaf is frozen)."""
    leaves = [
        jax.ShapeDtypeStruct((rows(leaf), *leaf.torch_shape[1:]), np.dtype(leaf.dtype))
        if leaf.trainable
        else None
        for leaf in layout.leaves
    ]
    return jax.tree_util.tree_unflatten(layout.treedef, leaves)


@dataclass(frozen=True, slots=True)
class _Rows:
    """Where a trainable parameter's rows are padding: device ``d`` holds rows
    ``[d * chunk_rows, (d + 1) * chunk_rows)`` of ``rows``, each of ``row_numel`` elements."""

    rows: int
    chunk_rows: int
    row_numel: int

    def valid(self, device: jax.Array) -> jax.Array:
        """How many of this device's elements are the parameter's (the rest pad)."""
        rows = jnp.clip(self.rows - device * self.chunk_rows, 0, self.chunk_rows)
        return rows * self.row_numel


class RowsUpdate:
    """``tx.update`` on each device's rows of the trainable parameters, exact (module doc).

    Built when the step is built: it proves the update exact on rows or refuses it.
    Called inside ``shard_map`` as ``update(grads, state, params, axes)``.

    Raises:
        ValueError: (at construction) an update that reads across the elements of a tensor
            other than through whole-tensor sums, maxima or finite tests, or across tensors
            (Adafactor's factored moments, a matrix orthogonalisation).
    """

    def __init__(self, tx: optax.GradientTransformationExtraArgs, layout: ParamLayout) -> None:
        self.tx = tx
        trainable = [leaf for leaf in layout.leaves if leaf.trainable]
        self.geometry = tuple(
            _Rows(leaf.rows, leaf.padded_rows, int(np.prod(leaf.torch_shape[1:], dtype=np.int64)))
            for leaf in trainable
        )
        whole = rows_tree(layout, lambda leaf: leaf.rows)
        local = rows_tree(layout, lambda leaf: leaf.padded_rows)
        try:
            space = model_space(tx, whole)
            soundness = Soundness(tx, space, whole, {}, totals=True)
        except Exception as err:  # what cannot be analysed is refused
            first = (str(err).strip().splitlines() or [""])[0]
            raise refusal(
                f"its update or state cannot be analysed on these parameters "
                f"({type(err).__name__}: {first})"
            ) from err
        chunk_shapes = [(leaf.padded_rows, *leaf.torch_shape[1:]) for leaf in trainable]
        local_state = jax.tree.leaves(jax.eval_shape(tx.init, local))
        aligned = [
            leaf.param is None or tuple(s.shape) == chunk_shapes[leaf.param]
            for leaf, s in zip(space.leaves, local_state, strict=True)
        ]
        if reason := soundness.coupled_reason():
            raise refusal(f"its {reason}")
        if reason := soundness.rows_problem(local, aligned, self.geometry):
            raise refusal(f"it {reason}")
        self.reduces = bool(soundness.analyser.totals)  # else: tx.update as it is
        if reason := soundness.init_rows_problem(local, self.geometry):
            raise refusal(f"its init {reason}")
        self.init_reduces = bool(soundness.analyser.totals)  # else: tx.init as it is
        n = len(trainable)
        self.roles = (
            [Role(i, "grad") for i in range(n)]
            + [
                Role(leaf.param, "state", ok)
                for leaf, ok in zip(space.leaves, aligned, strict=True)
            ]
            + [Role(i, "param") for i in range(n)]
        )

    def init(self, params: Any, axes: tuple[str, ...]) -> Any:
        """The optimizer state of this device's rows (inside ``shard_map``)."""
        if not self.init_reduces:
            return self.tx.init(params)
        roles = [Role(i, "param") for i in range(len(self.geometry))]
        return self._run(self.tx.init, (params,), roles, axes)

    def __call__(
        self, grads: Any, state: Any, params: Any, axes: tuple[str, ...]
    ) -> tuple[Any, Any]:
        """The updates and the new state of this device's rows (inside ``shard_map``)."""
        if not self.reduces:
            return self.tx.update(grads, state, params)
        return self._run(self.tx.update, (grads, state, params), self.roles, axes)

    def _run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        roles: list[Role],
        axes: tuple[str, ...],
    ) -> Any:
        """``fn(*args)`` traced here, its totals found again and completed (module doc)."""
        leaves, treedef = jax.tree.flatten(args)

        def flat_fn(*flat: Any) -> Any:
            return fn(*jax.tree.unflatten(treedef, flat))

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
        analyser = Analyser(totals=True)
        analyser.walk(closed, roles)
        outs = _Run(analyser.totals, self.geometry, axes).jaxpr(closed.jaxpr, closed.consts, leaves)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def refusal(problem: str) -> ValueError:
    return ValueError(
        "zero3_step cannot run this optimizer exactly on each device's rows of the "
        f"parameters: {problem}; it runs updates made of elementwise steps (SGD, Adam, AdamW, "
        "Lion) and whole-tensor sums completed across the devices (clip_by_global_norm, the "
        "trust ratios of LAMB and LARS); train this one with data_parallel_step(loss_fn, "
        "shard_optimizer(tx, mesh), mesh), whose default partition='auto' runs any Optax "
        "update exactly"
    )


# Each total's reduction: its identity (what a padding element becomes), the collective
# that completes it across the devices, and the dtype that collective runs in.
_IDENTITY = {
    "reduce_sum": lambda dt: 0,
    "reduce_max": lambda dt: -np.inf if jnp.issubdtype(dt, jnp.inexact) else jnp.iinfo(dt).min,
    "reduce_min": lambda dt: np.inf if jnp.issubdtype(dt, jnp.inexact) else jnp.iinfo(dt).max,
    "reduce_and": lambda dt: True,
    "reduce_or": lambda dt: False,
}
_COLLECTIVE = {
    "reduce_sum": lax.psum,
    "reduce_max": lax.pmax,
    "reduce_min": lax.pmin,
    "reduce_and": lax.pmin,
    "reduce_or": lax.pmax,
}


class _Total:
    """A total's local value until the all-reduce of every pending total sets ``value``."""

    __slots__ = ("local", "name", "value")

    def __init__(self, name: str, local: jax.Array) -> None:
        self.name, self.local, self.value = name, local, None


class _Run:
    """Binds a jaxpr's equations one by one inside ``shard_map``, completing the totals."""

    def __init__(
        self,
        totals: dict[int, frozenset[int]],
        geometry: Sequence[_Rows],
        axes: tuple[str, ...],
    ) -> None:
        self.totals, self.geometry, self.axes = totals, geometry, axes
        self.pending: list[_Total] = []

    def jaxpr(
        self, jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Any], *, outer: bool = True
    ) -> list[Any]:
        """The outputs of ``jaxpr``; a total stays pending (``_Total``) until an equation
        reads it, so the totals of a call's body travel with the caller's (``outer=False``)."""
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, inputs, strict=True))

        def pending(atom: Any) -> Any:
            return atom.val if isinstance(atom, jcore.Literal) else env[atom]

        def read(atom: Any) -> Any:
            value = pending(atom)
            if isinstance(value, _Total):
                if value.value is None:
                    self.flush()
                return value.value
            return value

        for eqn in jaxpr.eqns:
            if id(eqn) in self.totals:
                (operand,) = [read(a) for a in eqn.invars]
                outs: list[Any] = [self.total(eqn, operand, self.totals[id(eqn)])]
            elif eqn.primitive.name == "pvary":  # types follow the values (_bind aligns them)
                outs = [pending(a) for a in eqn.invars]
            elif (call := call_jaxpr(eqn)) is not None:  # as the analysis: the body inlined
                outs = self.jaxpr(*call, [pending(a) for a in eqn.invars], outer=False)
            else:
                outs = _bind(eqn, [read(a) for a in eqn.invars])
            env.update(zip(eqn.outvars, outs, strict=True))
        return [(read if outer else pending)(a) for a in jaxpr.outvars]

    def total(self, eqn: Any, operand: Any, deps: frozenset[int]) -> _Total:
        """This device's part of the reduction, its padding masked; all-reduced on read."""
        rows = {self.geometry[t] for t in deps}  # one: RowsUpdate checked it
        size = int(np.prod(np.shape(operand), dtype=np.int64))
        geometry = next(iter(rows))
        if len(rows) != 1 or size != geometry.chunk_rows * geometry.row_numel:
            raise ValueError(
                "gradsync internal error: a whole-tensor reduction of the optimizer has "
                f"{size} elements on a device and reads parameters cut as {sorted(map(str, rows))}"
            )
        name = eqn.primitive.name
        n = lax.axis_size(self.axes)
        if geometry.rows != n * geometry.chunk_rows:  # padding rows on some device
            index = jnp.arange(size, dtype=jnp.int32).reshape(np.shape(operand))
            keep = index < geometry.valid(lax.axis_index(self.axes))
            operand = jnp.where(keep, operand, _IDENTITY[name](operand.dtype))
        local = eqn.primitive.bind(operand, **eqn.params)
        total = _Total(name, cast_varying(local, self.axes))
        self.pending.append(total)
        return total

    def flush(self) -> None:
        """All-reduce every pending total: one collective per reduction and dtype."""
        groups: dict[tuple[str, str], list[_Total]] = {}
        for total in self.pending:
            groups.setdefault((total.name, str(total.local.dtype)), []).append(total)
        self.pending = []
        for (name, _), totals in groups.items():
            stacked = jnp.stack([t.local for t in totals])
            wire = stacked.astype(jnp.int32) if stacked.dtype == jnp.bool_ else stacked
            reduced = _COLLECTIVE[name](wire, self.axes).astype(stacked.dtype)
            for k, total in enumerate(totals):
                total.value = reduced[k]


def _aval_varying(aval: Any) -> frozenset[str]:
    mat = getattr(aval, "mat", None)  # as _axes.varying, for an abstract value
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _bind(eqn: Any, inputs: list[Any]) -> list[Any]:
    """Bind one equation on ``inputs``, whose variance over the manual axes can be less than
    traced (a completed total is the same on every device): an operation on several inputs
    gets them all varying where one is, as ``jax.numpy`` casts them; one with sub-jaxprs
    (``cond``, ``while``) gets each as traced."""
    if any(True for _ in jcore.jaxprs_in_params(eqn.params)):
        wanted = [_aval_varying(v.aval) for v in eqn.invars]
    else:
        union = frozenset().union(*(varying(x) for x in inputs))
        wanted = [union] * len(inputs)
    inputs = [
        lax.pcast(x, tuple(sorted(want - varying(x))), to="varying") if want - varying(x) else x
        for x, want in zip(inputs, wanted, strict=True)
    ]
    with eqn.ctx.manager:  # what the equation was traced under (xla_metadata, compute_on)
        out = eqn.primitive.bind(*inputs, **eqn.primitive.get_bind_params(eqn.params))
    return list(out) if eqn.primitive.multiple_results else [out]
