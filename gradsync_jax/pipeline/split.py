"""One stage's work cut into its three cells: forward, input gradient, weight gradient.

A stage is its units in order (the embedding on the first stage, its blocks, the head and
loss on the last) and its cells are pieces of ONE program: ``joint``, which runs the forward
and the whole backward of the stage unit by unit with ``jax.vjp`` and returns the output, the
gradient at every unit's input and the parameters' gradients. Its jaxpr is cut by what each
result needs (dead-code elimination, as XLA would do it):

- the forward (F): the equations the stage output (or the loss) needs;
- the input gradient (I): the further equations the gradients at the unit inputs need (the
  chain of input gradients back through the stage: what the previous stage waits for);
- the weight gradient (W): the rest of what the parameters' gradients need (the ``x^T g``
  products and bias sums: what zero bubble defers, arXiv:2401.10241).

So every equation of the backward runs exactly once, in the first cell that needs it, and a
full backward is I then W with nothing recomputed. What a later cell reads from an earlier
one is the **stash**: with ``stash="residuals"`` the forward's values the backward reads (what
``jax.vjp`` would keep), with ``stash="input"`` only the stage input, the input-gradient cell
recomputing the forward first. Values that depend only on the parameters (a transposed or
sliced weight) are never stashed: each cell that reads them recomputes them, since the
parameters are there at every tick (so is the microbatch's data, but what is computed from
it is the forward's work and is kept like any other value). The
stash of each cell is packed into flat rows, one per (dtype, varying axes), so the stages of
every type share fixed-size buffers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.core import DebugInfo, Jaxpr, Literal, Var

from gradsync_jax._axes import cast_varying
from gradsync_jax.pipeline.ticks import FIRST, LAST, ONLY

STASH_MODES = ("residuals", "input")

# Elementwise and layout primitives: memory-bound, no reduction, no communication. A later
# cell recomputes a forward value made by one of these rather than keep it.
RECOMPUTED = frozenset(
    "abs add add_any and broadcast_in_dim ceil clamp concatenate convert_element_type copy "
    "cos cosh div eq erf erf_inv erfc exp exp2 expand_dims expm1 floor ge gt integer_pow "
    "is_finite le log log1p logistic lt max min mul ne neg not or pad pow pvary reshape rev "
    "round rsqrt select_n sign sin sinh slice sqrt square squeeze stop_gradient sub tan "
    "tanh transpose".split()
)

RowKey = tuple[str, frozenset[str]]  # (dtype name, the mesh axes the values vary over)


def aval_varying(aval: Any) -> frozenset[str]:
    """The manual mesh axes an abstract value varies over (jax >= 0.9: ``aval.mat``)."""
    mat = getattr(aval, "mat", None)
    if mat is not None:
        return frozenset(mat.varying)
    return frozenset(getattr(aval, "vma", ()))


def row_key(aval: Any) -> RowKey:
    return (np.dtype(aval.dtype).name, aval_varying(aval))


@dataclass(frozen=True, slots=True)
class RowLayout:
    """Where each stashed value sits in the packed rows: ``(key, offset, shape)`` per value."""

    places: tuple[tuple[RowKey, int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, avals: Sequence[Any]) -> RowLayout:
        used: dict[RowKey, int] = {}
        places = []
        for aval in avals:
            key = row_key(aval)
            places.append((key, used.get(key, 0), tuple(aval.shape)))
            used[key] = used.get(key, 0) + math.prod(aval.shape)
        return cls(tuple(places))

    def sizes(self) -> dict[RowKey, int]:
        out: dict[RowKey, int] = {}
        for key, offset, shape in self.places:
            out[key] = max(out.get(key, 0), offset + math.prod(shape))
        return out

    def pack(self, values: Sequence[Any], rows: dict[RowKey, Any]) -> dict[RowKey, jax.Array]:
        """``values`` laid out in rows shaped like ``rows`` (zeros past them): one
        concatenation per row, so the row is written once."""
        parts: dict[RowKey, list[Any]] = {key: [] for key in rows}
        for (key, _, _), value in zip(self.places, values, strict=True):
            parts[key].append(jnp.ravel(value))
        out = {}
        for key, row in rows.items():
            used = sum(p.size for p in parts[key])
            if used < row.shape[0]:
                # the row's zero tail, made here (a slice of ``row``, made outside the
                # cell, would be filled at every tick): its type and axes
                tail = jnp.zeros((row.shape[0] - used,), row.dtype)
                vary = tuple(sorted(aval_varying(jax.typeof(row))))
                parts[key].append(cast_varying(tail, vary) if vary else tail)
            out[key] = jnp.concatenate(parts[key]) if len(parts[key]) > 1 else parts[key][0]
        return out

    def read(self, bufs: dict[RowKey, jax.Array], slot: Any) -> list[jax.Array]:
        """The values that ``pack`` laid out, read from row ``slot`` of the slotted buffers
        ``bufs`` (``(slots, size)`` per key): only their own places are read."""
        return [
            lax.dynamic_slice(bufs[key], (slot, offset), (1, math.prod(shape))).reshape(shape)
            for key, offset, shape in self.places
        ]


CrossKey = tuple[str, frozenset[str], tuple[int, ...], int]  # row key, shape, n-th of them


@dataclass(frozen=True, slots=True)
class CrossLayout:
    """Where each cross value sits: in a buffer of its own, one per (dtype, varying axes,
    shape, n-th value of those), so the stage types share the buffers of their shapes.

    Not packed into one row like the stash: a row is one concatenation, and XLA:CPU fuses
    each value's producer into it as well as into the input gradient's own next dot, so
    the input gradient computed its cross values twice (a GELU's derivative, the running
    sum of the residual's gradients; 9.5-10.2 ms against 5.3 apart, docs/pipeline.md). The
    input gradient returns each value in its own shape (``pack``) and the tick flattens it
    where it writes the buffer, outside the switch: returned flat, the value's producer was
    fused twice again, once into the flattening and once into the next dot (a GELU's
    derivative per block). The buffers are flat, read as a slice reshaped: read as a slot of
    a buffer shaped like the value, the split schedules' bits moved from a whole backward's
    (6e-8).
    """

    keys: tuple[CrossKey, ...]

    @classmethod
    def of(cls, avals: Sequence[Any]) -> CrossLayout:
        seen: dict[tuple[str, frozenset[str], tuple[int, ...]], int] = {}
        keys = []
        for aval in avals:
            base = (*row_key(aval), tuple(aval.shape))
            keys.append((*base, seen.get(base, 0)))
            seen[base] = seen.get(base, 0) + 1
        return cls(tuple(keys))

    def pack(self, values: Sequence[Any], keys: Sequence[CrossKey]) -> dict[CrossKey, Any]:
        """``values`` by their keys, each in its own shape (the writer flattens it), zeros
        (made here) for the ``keys`` of the other stage types' buffers."""
        out = {key: value for key, value in zip(self.keys, values, strict=True)}
        for key in keys:
            if key not in out:
                dtype, vary, shape, _ = key
                zero = jnp.zeros(shape, np.dtype(dtype))
                out[key] = cast_varying(zero, tuple(sorted(vary))) if vary else zero
        return {key: out[key] for key in keys}

    def read(self, bufs: dict[CrossKey, jax.Array], slot: Any) -> list[jax.Array]:
        """The values that ``pack`` returned, read from slot ``slot`` of the flat ``bufs``
        (``(slots, size)`` per key)."""
        shapes = [shape for _, _, shape, _ in self.keys]
        return [
            lax.dynamic_slice(bufs[key], (slot, 0), (1, math.prod(shape))).reshape(shape)
            for key, shape in zip(self.keys, shapes, strict=True)
        ]


@dataclass(frozen=True, slots=True, kw_only=True)
class StageCells:
    """The three cells of one stage type, as jaxprs over: the stage's parameters and the
    microbatch's data (always there), then the cell's own inputs.

    ``forward(params, data, x) -> (y, *stash)``; ``input_grad(params, data, *stash, g) ->
    (dx?, *cross)``; ``weight_grad(params, data, *stash, *cross) -> grads``. ``x`` is absent
    on the first stage (its input is the data), ``dx`` too; ``y`` is the loss on the last
    stage and ``g`` then the loss's seed (a scalar 1). The stash lives from the forward to
    the weight gradient, the cross values from the input to the weight gradient.
    """

    stage_type: str
    consts: tuple[Any, ...]
    forward: Jaxpr
    input_grad: Jaxpr
    weight_grad: Jaxpr
    stash: RowLayout
    cross: CrossLayout
    grads_tree: Any  # the treedef of the parameters' gradients

    def run(self, jaxpr: Jaxpr, *args: Any) -> list[Any]:
        return jax.core.eval_jaxpr(jaxpr, self.consts, *args)


def joint_fn(
    stage_type: str,
    embed: Callable[[Any, Any], jax.Array],
    block: Callable[[Any, jax.Array], jax.Array],
    head: Callable[[Any, jax.Array, Any], jax.Array],
    blocks_per_stage: int,
) -> Callable[..., tuple[Any, list[Any], Any]]:
    """``joint(params, data, x, g) -> (y, unit input gradients, parameter gradients)`` for one
    stage type; ``params = (embed, blocks, head)`` (``None`` where the stage has none),
    ``data = (inputs, targets)``."""
    first = stage_type in (FIRST, ONLY)
    last = stage_type in (LAST, ONLY)

    def joint(params: Any, data: Any, x: Any, g: Any) -> tuple[Any, list[Any], Any]:
        p_embed, p_blocks, p_head = params
        inputs, targets = data
        if first:
            a, embed_vjp = jax.vjp(lambda p: embed(p, inputs), p_embed)
        else:
            a = x
        block_vjps = []
        for i in range(blocks_per_stage):
            p_i = jax.tree.map(lambda leaf, i=i: leaf[i], p_blocks)
            a, vjp = jax.vjp(block, p_i, a)
            block_vjps.append(vjp)
        if last:
            y, head_vjp = jax.vjp(lambda p, a: head(p, a, targets), p_head, a)
        else:
            y = a
        grads_at_inputs = []
        d_head = d_embed = None
        if last:
            d_head, g = head_vjp(g)
            grads_at_inputs.append(g)
        d_blocks = []
        for vjp in reversed(block_vjps):
            d_i, g = vjp(g)
            d_blocks.append(d_i)
            grads_at_inputs.append(g)
        if first:
            (d_embed,) = embed_vjp(g)
        stacked = jax.tree.map(lambda *leaves: jnp.stack(leaves), *reversed(d_blocks))
        return y, grads_at_inputs, (d_embed, stacked, d_head)

    return joint


def split_stage(
    stage_type: str,
    joint: Callable[..., Any],
    params: Any,
    data: Any,
    x: Any,
    g: Any,
    *,
    stash: str,
) -> StageCells:
    """Trace ``joint`` on these (abstract or traced) arguments and cut it into its cells.

    Raises:
        ValueError: if the stage's program has side effects (a callback or a print), whose
            order a cut could change.
    """
    first = stage_type in (FIRST, ONLY)
    closed, shapes = jax.make_jaxpr(joint, return_shape=True)(params, data, x, g)
    jaxpr = closed.jaxpr
    # A collective's named-axis effect (a tensor-parallel psum) says which mesh axis it
    # talks over, not an order: every device of that axis runs the same cell in the same tick.
    ordered = [e for e in jaxpr.effects if type(e).__name__ != "NamedAxisEffect"]
    if ordered:
        raise ValueError(
            f"a pipeline stage's program has side effects ({ordered}); the executor cuts "
            "it into forward, input- and weight-gradient cells, which may reorder them: "
            "remove callbacks and prints from the model"
        )
    n_params = len(jax.tree.leaves(params))
    n_data = len(jax.tree.leaves(data))
    n_x = len(jax.tree.leaves(x))
    invars = list(jaxpr.invars)
    param_vars = invars[:n_params]
    data_vars = invars[n_params : n_params + n_data]
    x_vars = invars[n_params + n_data : n_params + n_data + n_x]
    g_vars = invars[n_params + n_data + n_x :]
    y_out, inputs_out, grads_out = _split_outs(shapes, jaxpr.outvars)
    dx_out = [] if first else inputs_out[-1:]

    always = set(param_vars) | set(data_vars) | set(jaxpr.constvars)
    # Free: what depends on the parameters alone. Not the data: on the first stage the whole
    # forward depends on the parameters and the inputs only, and must run once, not per cell.
    free = _free_eqns(jaxpr, set(param_vars) | set(jaxpr.constvars))
    f_set = _needed(jaxpr, range(len(jaxpr.eqns)), y_out)
    i_set = _needed(jaxpr, range(len(jaxpr.eqns)), inputs_out) - f_set
    w_set = _needed(jaxpr, range(len(jaxpr.eqns)), grads_out) - f_set - i_set

    # Each cell runs its own equations plus the free ones it reads. The backward cells also
    # recompute the forward's cheap elementwise work (a GELU, a normalisation's scaling) from
    # what they read instead of reading its results: what the forward keeps is the stage
    # input and the matmuls' and reductions' outputs (JAX's ``dots_saveable`` policy).
    cheap = {i for i in f_set if jaxpr.eqns[i].primitive.name in RECOMPUTED}
    f_made = {v for i in f_set for v in jaxpr.eqns[i].outvars} | set(x_vars)
    w_eqns, w_reads = _cell(jaxpr, w_set | free | cheap, grads_out, always)
    if stash == "residuals":
        # the weight gradient reads the forward's values from the stash, the input
        # gradient's from the cross values
        cross_vars = _ordered(jaxpr, w_reads - f_made)
        i_eqns, i_reads = _cell(
            jaxpr, i_set | cheap | free, dx_out + cross_vars, always | set(g_vars)
        )
        stash_vars = _ordered(jaxpr, (i_reads - set(g_vars)) | (w_reads & f_made))
    else:  # the input gradient recomputes the forward from the stage input
        cross_vars = _ordered(jaxpr, w_reads)
        i_eqns, _ = _cell(
            jaxpr, f_set | i_set | free, dx_out + cross_vars, always | set(g_vars) | set(x_vars)
        )
        stash_vars = list(x_vars)
    f_eqns, f_reads = _cell(jaxpr, f_set | free, y_out + stash_vars, always | set(x_vars))
    assert f_reads <= set(x_vars), "a forward read something that is neither input nor data"

    consts = tuple(closed.consts)
    constvars = list(jaxpr.constvars)

    def make(name: str, eqns: list[Any], ins: list[Var], outs: list[Any]) -> Jaxpr:
        info = DebugInfo(
            f"pipeline {stage_type} stage: {name}",
            None,  # type: ignore[arg-type]  # no source location: the cell is cut, not traced
            tuple(f"in{i}" for i in range(len(ins))),
            tuple(f"out{i}" for i in range(len(outs))),
        )
        effects = frozenset().union(*(eqn.effects for eqn in eqns))
        return Jaxpr(constvars, ins, outs, eqns, effects=effects, debug_info=info)

    return StageCells(
        stage_type=stage_type,
        consts=consts,
        forward=make("forward", f_eqns, param_vars + data_vars + x_vars, y_out + stash_vars),
        input_grad=make(
            "input gradient",
            i_eqns,
            param_vars + data_vars + stash_vars + g_vars,
            dx_out + cross_vars,
        ),
        weight_grad=make(
            "weight gradient", w_eqns, param_vars + data_vars + stash_vars + cross_vars, grads_out
        ),
        stash=RowLayout.of([v.aval for v in stash_vars]),
        cross=CrossLayout.of([v.aval for v in cross_vars]),
        grads_tree=jax.tree.structure(shapes[2]),
    )


def _split_outs(shapes: Any, outvars: list[Any]) -> tuple[list[Any], list[Any], list[Any]]:
    """The jaxpr's outputs as (stage output, unit input gradients, parameter gradients)."""
    sizes = [len(jax.tree.leaves(t)) for t in shapes]
    assert sum(sizes) == len(outvars)
    a, b = sizes[0], sizes[0] + sizes[1]
    return list(outvars[:a]), list(outvars[a:b]), list(outvars[b:])


def _free_eqns(jaxpr: Jaxpr, always: set[Any]) -> set[int]:
    """Equations whose every input is in ``always`` (the parameters, the constants) or
    another free equation's output: recomputed by any cell that reads them."""
    known = set(always)
    free = set()
    for i, eqn in enumerate(jaxpr.eqns):
        if all(isinstance(v, Literal) or v in known for v in eqn.invars):
            free.add(i)
            known.update(eqn.outvars)
    return free


def _needed(jaxpr: Jaxpr, allowed: Any, outs: Sequence[Any]) -> set[int]:
    """The equations among ``allowed`` that ``outs`` depend on (dead-code elimination)."""
    allowed = set(allowed)
    need = {v for v in outs if isinstance(v, Var)}
    keep = set()
    for i in range(len(jaxpr.eqns) - 1, -1, -1):
        eqn = jaxpr.eqns[i]
        if i in allowed and any(v in need for v in eqn.outvars):
            keep.add(i)
            need.update(v for v in eqn.invars if isinstance(v, Var))
    return keep


def _cell(
    jaxpr: Jaxpr, allowed: set[int], outs: Sequence[Any], avail: set[Any]
) -> tuple[list[Any], set[Any]]:
    """The equations of a cell that computes ``outs`` from ``allowed`` equations, and the
    values it reads from outside them and outside ``avail`` (what an earlier cell leaves)."""
    keep = _needed(jaxpr, allowed, outs)
    eqns = [jaxpr.eqns[i] for i in sorted(keep)]
    made = {v for eqn in eqns for v in eqn.outvars}
    reads = {v for eqn in eqns for v in eqn.invars if isinstance(v, Var)}
    reads |= {v for v in outs if isinstance(v, Var)}
    return eqns, {v for v in reads - made if v not in avail}


def _ordered(jaxpr: Jaxpr, values: set[Any]) -> list[Any]:
    """``values`` in the order the jaxpr defines them (inputs first): a deterministic layout."""
    order = {v: i for i, v in enumerate(jaxpr.invars)}
    for eqn in jaxpr.eqns:
        for v in eqn.outvars:
            order.setdefault(v, len(order))
    return sorted(values, key=order.__getitem__)
