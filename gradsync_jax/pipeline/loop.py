"""The tick loop: one pipeline step inside ``shard_map``, every device the same program.

A ``lax.scan`` over the plan's ticks (``ticks.py``). At tick t the device reads its row of the
table (``lax.axis_index("pp")``) and runs up to three cells, one per lane, each through its
own ``lax.switch``: the forward lane (idle, or the forward of its stage's type), the
backward lane (idle, a whole backward or an input gradient, ``split.py``) and the weight
lane (idle or a weight gradient; a phase without one has no weight lane). It writes
what the cells leave into their buffer slots, adds its parameter gradients to its stage's
sum, and sends each lane's output one hop with ``ppermute``; the neighbour that the table
names keeps it. Gradients are added in microbatch order: where the plan makes one early
(looped BFS), it waits in the ``held`` buffer and is added at the tick the table names, or
after the loop.

Why ``lax.scan`` and not an unrolled loop: the program and its compile time do not grow with
the microbatches (a tick is one body, m = 32 has ~70 ticks at pp 4), and its memory is the
carried buffers, whose slots are the plan's stash, nothing XLA could schedule otherwise.

What a tick costs beyond its cells: a switch's branches all return the same values, so a
branch returns zeros for what its cell does not make. The ticks run as up to three loops, one
per phase of the plan (``TickProgram.phases``: the forwards-only warm-up, the mixed middle,
the backwards-only cool-down), each body holding only the lanes, outputs, buffer writes,
gradient adds and ``ppermute`` shifts that its phase's cells make: GPipe's forward loop moves
no gradient, its backward loop no stash. A lane that is idle at some tick of its phase runs
under ``lax.cond``: idle, it computes, returns and writes nothing (no zero stash row into a
spare slot, no zero cross values, no add of a stage's zero gradients to its sums), and XLA
updates the buffers in place through the cond (the compiled idle branch is the buffers passed
through, no copy). Busy, its cell runs in a ``lax.switch`` of its own over the cells of its
kind, and the cond's branch writes what the switch returns: a write stays outside the cell's
own computation, so XLA fuses no value's producer into it (a fused producer ran twice,
``split.py``). A weight gradient has a lane of its own so that an input gradient returns no
gradients and a weight gradient no cross values. The branches read the stash and cross
buffers themselves (an operand of the switch is read in place; a row sliced before it was
copied out at every tick), after the forward lane wrote its stash row (read first, XLA copied
the stash buffer twice per tick; the slot written is never the one read, ``ticks.py``). The
zeros a branch returns are made inside it: a zero array made outside is an operand of the
switch, filled at every tick. A whole backward runs the input-gradient program, then the
weight-gradient program behind ``lax.optimization_barrier`` (one per value): nothing fused
across them, it rounds as the two halves do in ticks of their own.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gradsync_jax._axes import cast_varying
from gradsync_jax.pipeline.model import PipelineModel
from gradsync_jax.pipeline.split import (
    CrossLayout,
    RowKey,
    RowLayout,
    StageCells,
    aval_varying,
    joint_fn,
    split_stage,
)
from gradsync_jax.pipeline.ticks import (
    BACKWARD,
    COL,
    FIRST,
    FORWARD,
    GRADIENT_KINDS,
    INPUT,
    LAST,
    ONLY,
    TickProgram,
)


def run_pipeline(
    model: PipelineModel,
    program: TickProgram,
    params: tuple[Any, Any, Any],
    inputs: Any,
    targets: Any,
    *,
    blocks_per_stage: int,
    stash: str,
    axes: tuple[str, ...],
) -> tuple[jax.Array, tuple[Any, Any, Any]]:
    """Run one step of the plan on this device: the summed loss and parameter gradients.

    Call inside ``shard_map`` over a mesh with a ``pp`` axis.

    Args:
        model: the embedding, block and head functions.
        program: the compiled plan.
        params: this device's ``(embed, blocks (v, k, ...), head)``, varying over ``axes``.
        inputs: the microbatches' inputs, every leaf ``(m, ...)``.
        targets: the microbatches' targets, every leaf ``(m, ...)``.
        blocks_per_stage: k.
        stash: ``"residuals"`` or ``"input"`` (``split.py``).
        axes: the mesh axes the pipeline's values vary over: ``("pp", *data axes)``.

    Returns:
        ``(loss sum, (embed, blocks, head) gradient sums)`` over this device's microbatches
        and stages: summed over the microbatches, not divided; the embedding's and head's
        only on the ranks that hold the first and last stage (zeros elsewhere).
    """
    embed, blocks, head = params
    types = sorted({t for _, t in program.branches})
    zero_data = _cast((_index(inputs, 0), _index(targets, 0)), axes)
    act = jax.eval_shape(model.embed, embed, zero_data[0])
    if not isinstance(act, jax.ShapeDtypeStruct):
        raise ValueError(
            f"the embedding returns {jax.tree.structure(act)}; the pipeline moves one array "
            "between stages: return the activations as one array"
        )
    block0 = jax.tree.map(lambda leaf: leaf[0, 0], blocks)
    after = jax.eval_shape(model.block, block0, jax.ShapeDtypeStruct(act.shape, act.dtype))
    if not isinstance(after, jax.ShapeDtypeStruct) or (after.shape, after.dtype) != (
        act.shape,
        act.dtype,
    ):
        raise ValueError(
            f"a block maps activations {act.dtype.name}{list(act.shape)} to {after}; every "
            "block must keep the activations' shape and dtype"
        )
    loss = jax.eval_shape(
        model.head, head, jax.ShapeDtypeStruct(act.shape, act.dtype), zero_data[1]
    )
    if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
        raise ValueError(f"the head must return the microbatch's scalar loss, got {loss}")

    act_zero = _cast(jnp.zeros(act.shape, act.dtype), axes)
    loss_zero = _cast(jnp.zeros((), loss.dtype), axes)
    cells: dict[str, StageCells] = {}
    for t in types:
        joint = joint_fn(t, model.embed, model.block, model.head, blocks_per_stage)
        x = None if t in (FIRST, ONLY) else act_zero
        g = loss_zero if t in (LAST, ONLY) else act_zero
        p_t = _stage_params(t, embed, _index(blocks, 0), head)
        cells[t] = split_stage(t, joint, p_t, zero_data, x, g, stash=stash)

    stash_rows = _rows([c.stash for c in cells.values()])
    cross_rows = _cross_zeros([c.cross for c in cells.values()])
    grads_zero = _cast(jax.tree.map(jnp.zeros_like, (embed, _index(blocks, 0), head)), axes)
    cross_keys = list(cross_rows)
    no_cross = CrossLayout(())
    # zeros made where they are returned: a zero array made here and returned by a branch
    # is an operand of its switch, filled at every tick whether the branch runs or not
    act_zero_, loss_zero_, grads_zero_ = act_zero, loss_zero, grads_zero
    act_zero = lambda: _zeros(act_zero_)  # noqa: E731
    loss_zero = lambda: _zeros(loss_zero_)  # noqa: E731
    grads_zero = lambda: _zeros(grads_zero_)  # noqa: E731

    def forward(t: str) -> Callable[..., dict[str, Any]]:
        c = cells[t]
        first, last = t in (FIRST, ONLY), t in (LAST, ONLY)

        def run(p: Any, data: Any, x: Any, bufs: Any, slots: Any) -> dict[str, Any]:
            flat_p, flat_d = jax.tree.leaves(_stage_params(t, *p)), jax.tree.leaves(data)
            y, *kept = c.run(c.forward, *flat_p, *flat_d, *([] if first else [x]))
            send, lost = (act_zero(), y) if last else (y, loss_zero())
            return {"send": send, "loss": lost, "stash": c.stash.pack(kept, stash_rows)}

        return run

    def backward(kind: int, t: str) -> Callable[..., dict[str, Any]]:
        c = cells[t]
        first, last = t in (FIRST, ONLY), t in (LAST, ONLY)

        def run(p: Any, data: Any, g: Any, bufs: Any, slots: Any) -> dict[str, Any]:
            flat_p, flat_d = jax.tree.leaves(_stage_params(t, *p)), jax.tree.leaves(data)
            stash_read, cross_read = slots
            stashed = c.stash.read(bufs[0], stash_read)
            out = {"send": act_zero(), "cross": {}, "grads": None}
            if kind in (INPUT, BACKWARD):
                seed = loss_zero() + 1 if last else g
                outs = c.run(c.input_grad, *flat_p, *flat_d, *stashed, seed)
                dx, crossed = (act_zero(), outs) if first else (outs[0], outs[1:])
                out["send"] = dx
                if kind == INPUT:
                    out["cross"] = c.cross.pack(crossed, cross_keys)
                    out["grads"] = grads_zero()
                    return out
            else:
                crossed = c.cross.read(bufs[1], cross_read)
            if kind == BACKWARD:
                # the weight gradient as its own program, as in a tick of its own: XLA fuses
                # no work across the barrier, so a backward rounds as its two halves do
                # (one barrier per value: one over all would give each the union of their
                # varying mesh axes)
                stashed = [lax.optimization_barrier(v) for v in stashed]
                crossed = [lax.optimization_barrier(v) for v in crossed]
            grads = c.grads_tree.unflatten(
                c.run(c.weight_grad, *flat_p, *flat_d, *stashed, *crossed)
            )
            d_embed, d_blocks, d_head = grads
            zero = grads_zero()
            full = (
                zero[0] if d_embed is None else d_embed,
                d_blocks,
                zero[2] if d_head is None else d_head,
            )
            out["grads"] = _cast(full, axes)
            out["cross"] = no_cross.pack([], cross_keys)
            return out

        return run

    p = program.pp
    right = [(i, (i + 1) % p) for i in range(p)]
    left = [(i, (i - 1) % p) for i in range(p)]
    me = lax.axis_index("pp")
    holding = program.slots["held"] > 0
    # one stage per rank: its blocks are a static slice (no copy), not a dynamic one
    single = all(i == 0 for i in program.local_index)

    def stage_params(local: jax.Array) -> tuple[Any, Any, Any]:
        return (embed, _index(blocks, 0 if single else local), head)

    def add(sums: Any, local: jax.Array, grads: Any) -> Any:
        d_embed, d_blocks, d_head = grads
        return (
            jax.tree.map(jnp.add, sums[0], d_embed),
            jax.tree.map(lambda s, d: s.at[local].add(d), sums[1], d_blocks),
            jax.tree.map(jnp.add, sums[2], d_head),
        )

    def lane_switch(
        rows: np.ndarray, lane: str, make: Callable[[int, str], Callable[..., Any]]
    ) -> tuple[Any, set[int], set[str], bool]:
        """One lane's switch for this phase, over the cells it runs (idle not among them):
        its branch index of each of the program's branches, the branches, the cells'
        kinds, what its branches return, and whether the lane is ever idle in the phase."""
        used = np.unique(rows[:, :, COL[f"{lane}_branch"]])
        busy = [int(b) for b in used if b]
        kinds = {program.branches[b - 1][0] for b in busy}
        fields = set()
        if FORWARD in kinds:
            fields |= {"send", "loss", "stash"}
        if kinds & {INPUT, BACKWARD}:
            fields.add("send")
        if INPUT in kinds:
            fields.add("cross")
        if kinds & set(GRADIENT_KINDS):
            fields.add("grads")
        keep = lambda run: lambda *a: {k: v for k, v in run(*a).items() if k in fields}  # noqa: E731
        branches = [keep(make(*program.branches[b - 1])) for b in busy]
        index = np.zeros(len(program.branches) + 1, dtype=np.int32)
        index[busy] = np.arange(len(busy))
        return (jnp.asarray(index), branches), kinds, fields, bool(used[0] == 0)

    def phase(rows: np.ndarray) -> Callable[..., tuple[Any, None]]:
        """The tick body of one phase (``rows``: its ticks' tables): only the lanes, outputs,
        buffer writes, gradient adds and shifts that some cell of the phase makes. A lane
        that is idle at some tick of the phase runs under ``lax.cond``: idle, it computes,
        writes and adds nothing."""
        col_of = lambda name: rows[:, :, COL[name]]  # noqa: E731
        lanes = {
            "f": lane_switch(rows, "f", lambda _, t: forward(t)),
            "b": lane_switch(rows, "b", backward),
            "w": lane_switch(rows, "w", backward),
        }
        sources = [
            (buf, src)
            for buf, src in program.sources
            if (col_of(f"{buf}_from_{src}") != program.slots[buf]).any()
        ]
        adds_held = holding and bool((col_of("held_read") != program.slots["held"]).any())

        def shifted(send: jax.Array, srcs: set[str]) -> dict[str, jax.Array]:
            """``send`` as it arrives from each source in ``srcs``."""
            arriving = {"local": send}
            if "left" in srcs:
                arriving["left"] = lax.ppermute(send, "pp", right)
            if "right" in srcs:  # pp 2: the same shift
                again = p == 2 and "left" in srcs
                arriving["right"] = arriving["left"] if again else lax.ppermute(send, "pp", left)
            return arriving

        def run_lane(lane: str, state: dict[str, Any], col: Any, *args: Any) -> Any:
            """Run ``lane``'s cell of this tick and write what it leaves into ``state`` (the
            stash, loss, cross and gradient buffers); returns ``(state, what it sends)``."""
            (index, branches), _, fields, idles = lanes[lane]
            branch = col(f"{lane}_branch")
            local = col(f"{lane}_local")
            writes = {"stash", "loss"} if "stash" in fields else set()
            writes |= {"cross"} if "cross" in fields else set()
            writes |= {"held" if holding else "sums"} if "grads" in fields else set()

            def busy(mine: dict[str, Any]) -> tuple[dict[str, Any], Any]:
                # the cell in a switch of its own, its writes outside it: XLA fuses no
                # value's producer into its write (a fused producer runs twice, split.py)
                out = lax.switch(index[branch], branches, stage_params(local), *args)
                mine = dict(mine)
                if "stash" in out:
                    mine["stash"] = {
                        k: _write(b, col("stash_write"), out["stash"][k])
                        for k, b in mine["stash"].items()
                    }
                    mine["loss"] = mine["loss"] + out["loss"]
                if "cross" in out:  # flattened here: a flat value made in the cell was
                    # computed twice, for its buffer and for the cell's next dot (split.py)
                    mine["cross"] = {
                        k: _write(b, col("cross_write"), jnp.ravel(out["cross"][k]))
                        for k, b in mine["cross"].items()
                    }
                if "grads" in out and holding:  # every gradient passes through its held slot
                    mine["held"] = _write_tree(mine["held"], col("held_write"), out["grads"])
                elif "grads" in out:  # made in microbatch order: added as made
                    mine["sums"] = add(mine["sums"], local, out["grads"])
                return mine, out.get("send")

            def idle(mine: dict[str, Any]) -> tuple[dict[str, Any], Any]:
                return mine, act_zero() if "send" in fields else None

            mine = {k: state[k] for k in writes}
            mine, send = lax.cond(branch != 0, busy, idle, mine) if idles else busy(mine)
            return {**state, **mine}, send

        def tick(carry: Any, row_all: jax.Array) -> tuple[Any, None]:
            bufs, stashed, crossed, held, sums, loss_sum = carry
            row = row_all[me]
            col = lambda name: row[COL[name]]  # noqa: E731
            bufs = dict(bufs)
            arrived = {}
            state = {"stash": stashed, "loss": loss_sum, "cross": crossed, "held": held}
            state["sums"] = sums
            if lanes["f"][1]:
                mb = col("f_mb")
                data = _cast((_index(inputs, mb), _index(targets, mb)), axes)
                x = _index(bufs["act"], col("act_read"))
                state, send = run_lane("f", state, col, data, x, None, None)
                arrived["act"] = shifted(send, {s for b, s in sources if b == "act"})
            if lanes["b"][1]:
                mb = col("b_mb")
                data = _cast((_index(inputs, mb), _index(targets, mb)), axes)
                g = _index(bufs["grad"], col("grad_read"))
                # the branches read the stash and cross buffers in place: a row sliced
                # here would be copied out at every tick, read or not
                kept = (state["stash"], state["cross"])
                slots = (col("stash_read"), col("cross_read"))
                state, send = run_lane("b", state, col, data, g, kept, slots)
                if send is not None:
                    arrived["grad"] = shifted(send, {s for b, s in sources if b == "grad"})
            if lanes["w"][1]:  # after the backward lane: the cross values it reads may be new
                mb = col("w_mb")
                data = _cast((_index(inputs, mb), _index(targets, mb)), axes)
                kept = (state["stash"], state["cross"])
                slots = (col("w_stash_read"), col("cross_read"))
                state, _ = run_lane("w", state, col, data, None, kept, slots)
            sums = state["sums"]
            if adds_held:  # the spare slot is zeros: nothing added
                sums = add(sums, col("held_local"), _index(state["held"], col("held_read")))
            for buf, src in sources:
                bufs[buf] = _write(bufs[buf], col(f"{buf}_from_{src}"), arrived[buf][src])
            carry = (bufs, state["stash"], state["cross"], state["held"], sums, state["loss"])
            return carry, None

        return tick

    spare = {buf: n + 1 for buf, n in program.slots.items()}  # the last slot takes "none"
    carry = (
        {
            "act": _cast(jnp.zeros((spare["act"], *act.shape), act.dtype), axes),
            "grad": _cast(jnp.zeros((spare["grad"], *act.shape), act.dtype), axes),
        },
        {k: _slotted(r, spare["stash"]) for k, r in stash_rows.items()},
        {k: _slotted(r, spare["cross"]) for k, r in cross_rows.items()},
        _slotted_tree(grads_zero_, spare["held"] if holding else 0),
        _cast(jax.tree.map(jnp.zeros_like, (embed, blocks, head)), axes),
        loss_zero_,
    )
    for first, end in program.phases:
        rows = program.table[first:end]
        carry, _ = lax.scan(phase(rows), carry, jnp.asarray(rows))
    _, _, _, held, sums, loss_sum = carry
    if len(program.drain):  # the gradients still held, in microbatch order

        def drain(sums: Any, row_all: jax.Array) -> tuple[Any, None]:
            slot, local = row_all[me, 0], row_all[me, 1]
            return add(sums, local, _index(held, slot)), None

        sums, _ = lax.scan(drain, sums, jnp.asarray(program.drain))
    return loss_sum, sums


def _stage_params(t: str, embed: Any, blocks: Any, head: Any) -> tuple[Any, Any, Any]:
    """The parameters a stage of type ``t`` reads: ``None`` for the parts it does not hold."""
    first, last = t in (FIRST, ONLY), t in (LAST, ONLY)
    return (embed if first else None, blocks, head if last else None)


def _index(tree: Any, i: Any) -> Any:
    return jax.tree.map(lambda leaf: lax.dynamic_index_in_dim(leaf, i, keepdims=False), tree)


def _cast(tree: Any, axes: tuple[str, ...]) -> Any:
    return cast_varying(tree, axes)


def _rows(layouts: list[RowLayout]) -> dict[RowKey, jax.Array]:
    """One zero row per (dtype, varying axes), as long as the longest stage type needs."""
    sizes: dict[RowKey, int] = {}
    for layout in layouts:
        for key, size in layout.sizes().items():
            sizes[key] = max(sizes.get(key, 0), size)
    rows = {}
    for key, size in sorted(sizes.items(), key=lambda kv: (kv[0][0], sorted(kv[0][1]))):
        dtype, vary = key
        rows[key] = _vary(jnp.zeros((size,), np.dtype(dtype)), vary)
    return rows


def _cross_zeros(layouts: list[CrossLayout]) -> dict[Any, jax.Array]:
    """One zero value per cross buffer that some stage type writes (``CrossLayout``)."""
    keys = sorted(
        {key for layout in layouts for key in layout.keys},
        key=lambda k: (k[0], sorted(k[1]), k[2], k[3]),
    )
    zeros = {}
    for key in keys:
        dtype, vary, shape, _ = key
        zeros[key] = _vary(jnp.zeros((math.prod(shape),), np.dtype(dtype)), vary)
    return zeros


def _zeros(tree: Any) -> Any:
    """Fresh zeros shaped, typed and varying like ``tree``'s leaves."""
    return jax.tree.map(
        lambda z: _vary(jnp.zeros(z.shape, z.dtype), aval_varying(jax.typeof(z))), tree
    )


def _slotted(row: jax.Array, slots: int) -> jax.Array:
    return _vary(jnp.zeros((slots, *row.shape), row.dtype), aval_varying(jax.typeof(row)))


def _slotted_tree(tree: Any, slots: int) -> Any:
    """``slots`` copies of ``tree``'s zeros, stacked on a leading dimension (0: none)."""
    return jax.tree.map(
        lambda z: _vary(jnp.zeros((slots, *z.shape), z.dtype), aval_varying(jax.typeof(z))),
        tree,
    )


def _write_tree(buf: Any, slot: jax.Array, value: Any) -> Any:
    return jax.tree.map(lambda b, v: _write(b, slot, v), buf, value)


def _vary(x: jax.Array, axes: frozenset[str]) -> jax.Array:
    return cast_varying(x, tuple(sorted(axes))) if axes else x


def _write(buf: jax.Array, slot: jax.Array, value: jax.Array) -> jax.Array:
    """``buf[slot] = value``, in place: a tick that keeps nothing writes the spare slot."""
    return lax.dynamic_update_index_in_dim(buf, value, slot, 0)
