"""Data-dependency analysis of an Optax update, from its jaxpr (docs/jax-zero.md, "Soundness").

``shard_optimizer`` runs the inner transformation on a share of the parameters only: whole
tensors (greedy) or element ranges that cut through tensors (flat). That equals the unsharded
update only if (greedy) each tensor's outputs read nothing but that tensor's own inputs and
values that are the same on every device, and (flat) additionally every operation between a
tensor's inputs and its outputs is elementwise and the same for every tensor.

Rather than guess from names or a few numbers, this module traces the update to a jaxpr on
abstract values and walks its equations, giving every value an ``Node``: which tensors it
reads (``deps``), whether it is elementwise in them (``kind``), and a structural signature
(``sig``) that is equal for two values exactly when they are computed the same way from inputs
playing the same role. Sub-jaxprs of calls are inlined; ``cond`` is followed branch by branch;
loops (``while``, ``scan``) are treated as opaque, reading all of their inputs.

``Analyser(totals=True)`` is the analysis of an update run on each device's rows of every
tensor with its whole-tensor reductions completed across the devices (``zero3_step``,
``param_sharding/update.py``): a reduction over every axis of one tensor's elementwise values
(``jnp.sum(g * g)`` of a global norm, LAMB's trust ratio, an all-finite test) then reads no
tensor and is the same on every device, a *total*; the walk records each one and the tensors
it reads, so the executor knows which equations to all-reduce and which padding to mask.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.extend import core as jcore

# How a value relates to the positions of the tensor it belongs to.
UNIFORM = 0  # the same at every position (a scalar, a broadcast scalar): reads no tensor
POSITION = 1  # reads no tensor but varies with the position (iota, random bits, a constant)
ELEMENT = 2  # reads tensors, position by position
MIXED = 3  # reads tensors across positions (a reduction, a transpose, a gather, ...)

ELEMENTWISE = frozenset(
    """abs acos acosh add and asin asinh atan atan2 atanh cbrt ceil clamp conj
    convert_element_type copy copy_p cos cosh digamma div eq erf erf_inv erfc exp exp2 expm1
    floor ge gt igamma imag integer_pow is_finite le lgamma log log1p logistic lt max min mul
    ne neg nextafter not or polygamma pow real reduce_precision rem round rsqrt select_n sign
    sin sinh sqrt square stop_gradient sub tan tanh xor shift_left shift_right_logical
    shift_right_arithmetic population_count clz""".split()
)
# Primitives that keep the row-major order of the elements: the identity for the analysis
# (``pvary``: shard_map's variance cast, in an update traced inside ``shard_map``).
ORDER_PRESERVING = frozenset({"reshape", "squeeze", "expand_dims", "pvary"})
# Reductions a total can be (``Analyser(totals=True)``): each has a cross-device twin.
TOTALS = frozenset({"reduce_sum", "reduce_max", "reduce_min", "reduce_and", "reduce_or"})
# Parameters that only restate shapes or placements (they differ between a tensor and a chunk).
_SHAPE_PARAMS = frozenset(
    {"shape", "sharding", "out_sharding", "broadcast_dimensions", "new_sizes", "dimensions"}
)


@dataclass(frozen=True, slots=True)
class Node:
    """What the analysis knows about one value of the traced update."""

    deps: frozenset[int]  # the tensors (keys of the caller's roles) it reads
    kind: int  # UNIFORM, POSITION, ELEMENT or MIXED
    sig: int  # structural signature, interned
    culprit: str | None = None  # the first operation that made it MIXED


@dataclass(frozen=True, slots=True)
class Role:
    """The part one input leaf plays: ``tensor`` (None: shared by all devices) and a label
    that is the same for every tensor (``"grad"``, ``("state", "0.mu")``, ``"count"``)."""

    tensor: int | None
    label: Hashable
    # False for a tensor's input that is not laid out like the tensor's rows (a factored
    # moment): it varies with the device but not position by position, so it mixes.
    aligned: bool = True


class _Interner:
    def __init__(self) -> None:
        self.ids: dict[Hashable, int] = {}

    def __call__(self, key: Hashable) -> int:
        return self.ids.setdefault(key, len(self.ids))


def _hashable(value: Any) -> Hashable:
    try:
        hash(value)
    except TypeError:
        return repr(value)
    return value if isinstance(value, str | int | float | bool | type(None)) else repr(value)


def _params_key(params: dict[str, Any], drop_shapes: bool) -> Hashable:
    return tuple(
        (k, _hashable(v))
        for k, v in sorted(params.items())
        if not (drop_shapes and k in _SHAPE_PARAMS)
    )


def _shape(atom: Any) -> tuple[int, ...]:
    return tuple(getattr(atom.aval, "shape", ()))


class _Walker:
    """Evaluates a jaxpr on ``Node``s instead of arrays."""

    def __init__(self, totals: bool = False) -> None:
        self.intern = _Interner()
        self.totals_mode = totals
        self.totals: dict[int, frozenset[int]] = {}  # id(equation) -> the tensors it reduces
        self._in_cond = 0  # inside a cond branch a reduction cannot be all-reduced

    def literal(self, value: Any, aval: Any) -> Node:
        array = np.asarray(value)
        if array.size <= 1 or bool(np.all(array == array.ravel()[0])):
            kind = UNIFORM
            key: Hashable = ("lit", str(array.dtype), repr(array.ravel()[:1].tolist()))
        else:
            kind = POSITION
            key = ("lit", str(array.dtype), array.shape, array.tobytes())
        return Node(frozenset(), kind, self.intern(key))

    def run(self, jaxpr: Any, consts: Sequence[Any], inputs: Sequence[Node]) -> list[Node]:
        env: dict[Any, Node] = {}
        for var, value in zip(jaxpr.constvars, consts, strict=True):
            env[var] = self.literal(value, var.aval)
        for var, node in zip(jaxpr.invars, inputs, strict=True):
            env[var] = node

        def read(atom: Any) -> Node:
            if isinstance(atom, jcore.Literal):
                return self.literal(atom.val, atom.aval)
            return env[atom]

        for eqn in jaxpr.eqns:
            outs = self.equation(eqn, [read(a) for a in eqn.invars])
            for var, node in zip(eqn.outvars, outs, strict=True):
                env[var] = node
        return [read(a) for a in jaxpr.outvars]

    def equation(self, eqn: Any, nodes: list[Node]) -> list[Node]:
        name = eqn.primitive.name
        deps = frozenset().union(*(n.deps for n in nodes))
        if name == "cond":
            return self._cond(eqn, nodes)
        call = call_jaxpr(eqn)
        if call is not None:
            jaxpr, consts = call
            return self.run(jaxpr, consts, nodes)
        if name in ELEMENTWISE:
            out_shape = _shape(eqn.outvars[0])
            kind, culprit = _combine(nodes, [_shape(a) for a in eqn.invars], out_shape, name)
            key = (name, _params_key(eqn.params, True), tuple(n.sig for n in nodes))
            return [Node(deps, kind, self.intern(key), culprit)]
        if name in ORDER_PRESERVING:
            return [nodes[0]]
        if self.totals_mode and name in TOTALS and self._is_total(eqn, nodes[0]):
            self.totals[id(eqn)] = nodes[0].deps
            return [Node(frozenset(), UNIFORM, self.intern(("total", name, nodes[0].sig)))]
        if name == "broadcast_in_dim":
            (src,) = nodes[:1]
            in_shape, out_shape = _shape(eqn.invars[0]), _shape(eqn.outvars[0])
            if in_shape == out_shape:
                return [src]
            if int(np.prod(in_shape, dtype=np.int64)) == 1 and src.kind == UNIFORM:
                return [Node(src.deps, UNIFORM, self.intern(("bcast", src.sig)))]
            kind = MIXED if src.deps or src.kind == MIXED else POSITION
            culprit = src.culprit or ("broadcast_in_dim" if kind == MIXED else None)
            return [Node(src.deps, kind, self.intern(("bcast", in_shape, src.sig)), culprit)]
        # Anything else (reductions, dot_general, transpose, gather, sort, cumsum, loops,
        # random bits) mixes positions: harmless on shared values, not on a tensor's values.
        key = (name, _params_key(eqn.params, False), tuple(n.sig for n in nodes))
        culprit = next((n.culprit for n in nodes if n.culprit), None) or name
        outs = []
        for k, var in enumerate(eqn.outvars):
            if deps or any(n.kind == MIXED for n in nodes):
                kind = MIXED
            else:
                kind = UNIFORM if _shape(var) == () else POSITION
            outs.append(
                Node(deps, kind, self.intern((*key, k)), culprit if kind == MIXED else None)
            )
        return outs

    def _is_total(self, eqn: Any, src: Node) -> bool:
        """A reduction over every axis of tensors' values, position by position."""
        ndim = len(_shape(eqn.invars[0]))
        every_axis = sorted(eqn.params.get("axes", ())) == list(range(ndim))
        return every_axis and src.kind == ELEMENT and bool(src.deps) and not self._in_cond

    def _cond(self, eqn: Any, nodes: list[Node]) -> list[Node]:
        index, operands = nodes[0], nodes[1:]
        self._in_cond += 1
        try:
            per_branch = [
                self.run(branch.jaxpr, branch.consts, operands) for branch in eqn.params["branches"]
            ]
        finally:
            self._in_cond -= 1
        outs = []
        for k in range(len(eqn.outvars)):
            results = [branch[k] for branch in per_branch]
            deps = index.deps.union(*(r.deps for r in results))
            kinds = {r.kind for r in results}
            culprit = next((r.culprit for r in results if r.culprit), None)
            if index.deps or MIXED in kinds or {ELEMENT, POSITION} <= kinds:
                kind, culprit = MIXED, culprit or "cond"
            else:
                kind = max(kinds)
            key = ("cond", index.sig, tuple(r.sig for r in results))
            outs.append(Node(deps, kind, self.intern(key), culprit if kind == MIXED else None))
        return outs


def call_jaxpr(eqn: Any) -> tuple[Any, Sequence[Any]] | None:
    """The body of a call-like equation (``jit``, ``custom_jvp_call``, ``remat``, ...) whose
    inputs and outputs are the equation's own, else None."""
    if eqn.primitive.name in ("while", "scan"):
        return None
    for value in eqn.params.values():
        if isinstance(value, jcore.ClosedJaxpr):
            jaxpr, consts = value.jaxpr, value.consts
        elif isinstance(value, jcore.Jaxpr):
            jaxpr, consts = value, ()
        else:
            continue
        if len(jaxpr.invars) == len(eqn.invars) and len(jaxpr.outvars) == len(eqn.outvars):
            return jaxpr, consts
    return None


def _combine(
    nodes: list[Node], shapes: list[tuple[int, ...]], out_shape: tuple[int, ...], name: str
) -> tuple[int, str | None]:
    """The kind of an elementwise operation's result, and what made it MIXED."""
    for node in nodes:
        if node.kind == MIXED:
            return MIXED, node.culprit
    kinds = {n.kind for n in nodes}
    if ELEMENT in kinds:
        if POSITION in kinds:
            return MIXED, f"{name} with a position-dependent constant"
        if any(n.kind == ELEMENT and s != out_shape for n, s in zip(nodes, shapes, strict=True)):
            return MIXED, f"{name} broadcasting a tensor"
        return ELEMENT, None
    return (POSITION if POSITION in kinds else UNIFORM), None


class Analyser:
    """Traces updates to ``Node``s; signatures are comparable across one analyser's traces.

    ``totals``: whole-tensor reductions are totals (module docstring); ``totals`` then maps
    each one of the last trace (``id`` of its equation) to the tensors it reduces.
    """

    def __init__(self, *, totals: bool = False) -> None:
        self._walker = _Walker(totals)

    @property
    def totals(self) -> dict[int, frozenset[int]]:
        return self._walker.totals

    def trace(
        self, fn: Callable[..., Any], args: Sequence[Any], roles: Sequence[Role]
    ) -> tuple[list[Node], Any]:
        """Trace ``fn(*args)`` (leaves: ``ShapeDtypeStruct``); a ``Node`` per output leaf in
        flattening order, and the output treedef. ``roles``: one per input leaf."""
        leaves, treedef = jax.tree.flatten(args)
        if len(leaves) != len(roles):
            raise ValueError(f"gradsync internal error: {len(leaves)} inputs, {len(roles)} roles")

        def flat_fn(*flat: Any) -> Any:
            return fn(*jax.tree.unflatten(treedef, flat))

        closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*leaves)
        return self.walk(closed, roles), jax.tree.structure(out_shape)

    def walk(self, closed: Any, roles: Sequence[Role]) -> list[Node]:
        """A ``Node`` per output of the traced ``closed`` jaxpr; ``roles``: one per input."""
        intern = self._walker.intern
        self._walker.totals = {}
        inputs = []
        for var, role in zip(closed.jaxpr.invars, roles, strict=True):
            key = ("in", role.label, str(var.aval.dtype))
            if role.tensor is not None and not role.aligned:
                culprit = "a state leaf not laid out like its parameter's rows"
                inputs.append(Node(frozenset({role.tensor}), MIXED, intern(key), culprit))
            elif role.tensor is not None:
                inputs.append(Node(frozenset({role.tensor}), ELEMENT, intern(key)))
            else:  # shared by every device: a count, a hyper-parameter, a PRNG key, a loss
                kind = UNIFORM if np.prod(var.aval.shape, dtype=np.int64) <= 1 else POSITION
                inputs.append(Node(frozenset(), kind, intern(key)))
        return self._walker.run(closed.jaxpr, closed.consts, inputs)
