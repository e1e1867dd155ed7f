"""Each parameter gathered where the model reads it, and again for its backward.

Handing the loss every parameter whole at the start of the step leaves the gathers depending
only on the chunks, so XLA may issue all of them before the first matmul, and XLA:CPU's
default scheduler does: every gathered unit is live at once (docs/jax-zero3.md, "Where the
temporary bytes go"). FSDP2 avoids that with a module hook per unit; JAX has no hooks, so
``call_gathering_on_first_read`` runs the loss's jaxpr (traced once, on the gathered
parameters' types) equation by equation, the way a custom JAX interpreter does, and gathers
a parameter at the first equation that computes with it, reading its chunks through that
equation's other operands (``gather._read_after``): the order is a data dependency, which no
scheduler can undo. Layout-only equations on a parameter (a transpose, a reshape, a cast) are
folded into what is gathered, and calls of ``jax.jit`` functions are entered, so "computes
with" means the matmul, not the transpose before it.

With ``reshard_after_forward`` each equation that computes with gathered parameters becomes
one custom-VJP call that keeps only the chunks for its backward, as FSDP2's post-forward
reshard does: the backward gathers them again, read through that equation's output
cotangent, so the gathers of the backward follow the backward too. Without it a unit is
gathered once, at its first read, and kept to the backward.

Each equation is bound as JAX would bind it, on the same values: what the loss computes is
unchanged.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import jax
from jax.extend.core import Jaxpr, JaxprEqn, Literal
from jax.extend.core.primitives import jit_p

from gradsync_jax.param_sharding.gather import Gatherer

# Equations that only move or cast a parameter's elements: applied to the gathered parameter
# inside the gather of the equation that computes with it (and recomputed for its backward).
_LAYOUT = frozenset(
    {
        "reshape",
        "transpose",
        "broadcast_in_dim",
        "squeeze",
        "expand_dims",
        "convert_element_type",
        "slice",
        "copy",
        "copy_p",
    }
)


class _Derived:
    """A value made from gathered parameters ``leaves`` by layout equations: ``fn(whole)``
    with ``whole`` the gathered leaves by index."""

    __slots__ = ("fn", "leaves")

    def __init__(self, leaves: frozenset[int], fn: Callable[[dict[int, jax.Array]], Any]):
        self.leaves, self.fn = leaves, fn


def _bind(eqn: JaxprEqn, values: Sequence[Any]) -> list[Any]:
    with eqn.ctx.manager:
        outs = eqn.primitive.bind(*values, **eqn.primitive.get_bind_params(eqn.params))
    return list(outs) if eqn.primitive.multiple_results else [outs]


def _folded(eqn: JaxprEqn, values: list[Any], k: int) -> _Derived:
    """The layout equation ``eqn`` applied to the derived operand ``values[k]``."""
    source = values[k]

    def fn(whole: dict[int, jax.Array]) -> Any:
        return _bind(eqn, [source.fn(whole) if i == k else v for i, v in enumerate(values)])[0]

    return _Derived(source.leaves, fn)


class _Interpreter:
    def __init__(self, chunks: Sequence[jax.Array], gather: Gatherer, reshard: bool) -> None:
        self.chunks, self.gather, self.reshard = chunks, gather, reshard
        self.units = [leaf.unit for leaf in gather.layout.leaves]
        self.kept: dict[int, jax.Array] = {}  # without resharding: gathered once, kept

    def run(self, jaxpr: Jaxpr, consts: Sequence[Any], args: Sequence[Any]) -> list[Any]:
        env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts, strict=True))
        env.update(zip(jaxpr.invars, args, strict=True))

        def read(v: Any) -> Any:
            return v.val if isinstance(v, Literal) else env[v]

        for eqn in jaxpr.eqns:
            values = [read(v) for v in eqn.invars]
            derived = [k for k, v in enumerate(values) if isinstance(v, _Derived)]
            arrays = [k for k, v in enumerate(values) if isinstance(v, jax.Array)]
            if not derived:
                outs = _bind(eqn, values)
            elif eqn.primitive is jit_p:
                inner = eqn.params["jaxpr"]
                with eqn.ctx.manager:
                    outs = self.run(inner.jaxpr, inner.consts, values)
            elif eqn.primitive.name in _LAYOUT and len(derived) == 1 and not arrays:
                outs = [_folded(eqn, values, derived[0])]
            elif self.reshard and not eqn.effects:
                outs = self.resharded(eqn, values)
            else:
                outs = _bind(eqn, self.kept_values(values))
            env.update(zip(eqn.outvars, outs, strict=True))
        return self.kept_values([read(v) for v in jaxpr.outvars])

    def kept_values(self, values: list[Any]) -> list[Any]:
        """``values`` with the derived ones computed from kept gathered units (each unit
        gathered whole at its first read, once the other values exist)."""
        after = [v for v in values if isinstance(v, jax.Array)]
        for v in values:
            if isinstance(v, _Derived):
                for unit in sorted({self.units[i] for i in v.leaves if i not in self.kept}):
                    members = [i for i, u in enumerate(self.units) if u == unit]
                    whole = self.gather(members, [self.chunks[i] for i in members], after)
                    self.kept.update(zip(members, whole, strict=True))
        return [v.fn(self.kept) if isinstance(v, _Derived) else v for v in values]

    def resharded(self, eqn: JaxprEqn, values: list[Any]) -> list[Any]:
        """``eqn`` on its gathered parameters as one custom-VJP call from (other operands,
        chunks): gathered after the operands, and again in the backward after the output's
        cotangent; only the chunks and the operands are kept for the backward."""
        leaves = sorted(frozenset().union(*(v.leaves for v in values if isinstance(v, _Derived))))
        arrays = [k for k, v in enumerate(values) if isinstance(v, jax.Array)]
        gather = self.gather

        def compute(operands: tuple, chunks: tuple, after: Sequence[Any]) -> list[Any]:
            whole = dict(zip(leaves, gather(leaves, chunks, after), strict=True))
            full = list(values)
            for k, x in zip(arrays, operands, strict=True):
                full[k] = x
            return _bind(eqn, [v.fn(whole) if isinstance(v, _Derived) else v for v in full])

        @jax.custom_vjp
        def call(operands: tuple, chunks: tuple) -> list[Any]:
            return compute(operands, chunks, operands)

        def fwd(operands: tuple, chunks: tuple) -> tuple[list[Any], tuple]:
            return compute(operands, chunks, operands), (operands, chunks)

        def bwd(res: tuple, cotangents: list[Any]) -> tuple[Any, Any]:
            operands, chunks = res
            _, vjp = jax.vjp(lambda o, c: compute(o, c, cotangents), operands, chunks)
            return vjp(cotangents)

        call.defvjp(fwd, bwd)
        return call(tuple(values[k] for k in arrays), tuple(self.chunks[i] for i in leaves))


def call_gathering_on_first_read(
    fn: Callable[[list[jax.Array], Any], Any],
    chunks: Sequence[jax.Array],
    gather: Gatherer,
    batch: Any,
    *,
    reshard: bool,
) -> Any:
    """``fn(whole, batch)``, where ``whole[i]`` is the parameter of ``chunks[i]`` (leaf ``i``
    of ``gather``'s layout) gathered where the computation first computes with it.

    ``reshard``: gather again for each equation's backward and keep only the chunks between
    (FSDP2's ``reshard_after_forward``); otherwise each unit is gathered whole at its first
    read and kept.
    """
    indices = list(range(len(chunks)))
    avals = jax.make_jaxpr(lambda *c: gather(indices, c, ()))(*chunks).out_avals
    batch_leaves, batch_tree = jax.tree.flatten(batch)
    closed, out_shape = jax.make_jaxpr(
        lambda w, b: fn(w, jax.tree.unflatten(batch_tree, b)), return_shape=True
    )(list(avals), batch_leaves)
    unread = [_Derived(frozenset((i,)), operator.itemgetter(i)) for i in indices]
    interpreter = _Interpreter(chunks, gather, reshard)
    outs = interpreter.run(closed.jaxpr, closed.consts, unread + batch_leaves)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)
