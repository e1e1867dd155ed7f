"""Whether a partition runs the inner transformation exactly, decided from its jaxpr.

``Soundness`` traces ``inner.update`` once on the whole (abstract) parameter tree, then once
per program a partition really runs: greedy runs it on each device's owned subtree, flat on a
tuple of 1-D bucket chunks. A partition is sound when every output it keeps reads only its own
tensor (plus values shared by every device) and is computed exactly as in the whole-tree
update (equal signatures, ``analysis``); flat also needs every such output to be elementwise.
The methods return ``None`` or one sentence naming what couples tensors and what to do.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import jax
import numpy as np
import optax

from gradsync_jax.zero.analysis import ELEMENT, UNIFORM, Analyser, Node, Role
from gradsync_jax.zero.clip import global_norm_args
from gradsync_jax.zero.flat import FlatLayout, NotElementwiseError, build_flat, not_elementwise
from gradsync_jax.zero.greedy import GreedyLayout
from gradsync_jax.zero.matrices import MUON_REASON, keeps_muon_state
from gradsync_jax.zero.model_space import ModelSpace, model_space, path_parts, signature

_NORM = jax.ShapeDtypeStruct((), np.float32)  # gradsync_jax.clip_by_global_norm's norm
_FIX = (
    "use partition='auto' or 'gathered' (the update then runs on the whole tree, exactly), or "
    "gradsync_jax.clip_by_global_norm first in the chain instead of optax.clip_by_global_norm"
)


def split_extra_args(extra_args: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(array arguments as ``ShapeDtypeStruct``, other arguments such as a ``value_fn``)."""
    arrays, others = {}, {}
    for key, value in extra_args.items():
        leaves = jax.tree.leaves(value)
        if leaves and all(hasattr(x, "dtype") and hasattr(x, "shape") for x in leaves):
            arrays[key] = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), value)
        elif all(isinstance(x, int | float) for x in leaves):
            arrays[key] = jax.tree.map(lambda x: jax.ShapeDtypeStruct((), np.float32), value)
        else:
            others[key] = value
    return arrays, others


class Soundness:
    """The whole-tree analysis of ``inner.update`` for one parameter tree."""

    def __init__(
        self,
        inner: optax.GradientTransformationExtraArgs,
        space: ModelSpace,
        params: Any,
        extra_args: dict[str, Any],
        *,
        with_params: bool = True,
        where: str = "",
        totals: bool = False,
    ) -> None:
        self.inner, self.space, self.params = inner, space, params
        self.arrays, self.others = split_extra_args(extra_args)
        self.with_params = with_params
        self.where = where  # " (on a sample tree ...)" when not the user's parameters
        # totals: the update runs on rows with its whole-tensor reductions all-reduced
        # (zero3_step): no global_norm= is passed, the reductions are (analysis.Analyser).
        self.totals = totals
        self.analyser = Analyser(totals=totals)
        # Each layout's problem, by exactly what ``_greedy_problem`` / ``_flat_problem`` read
        # of the layout (the rest they read is this object's): planning "greedy", "flat" and
        # "auto" for one optimizer (one cached analysis, ``analysed``) traces each layout once.
        self._problems: dict[Hashable, str | None] = {}
        self.specs = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in space.specs]
        state = jax.eval_shape(inner.init, params)
        roles = [Role(leaf.param, self._label_of(k)) for k, leaf in enumerate(space.leaves)]
        updates, new_state = self._trace(self.specs, state, roles)
        self.updates: list[Node] = updates
        self.state: list[Node] = new_state

    def _trace(
        self, grads: list[Any], state: Any, state_roles: list[Role]
    ) -> tuple[list[Node], list[Node]]:
        """Trace one update of ``grads`` (``None`` where absent) and ``state``; Nodes of the
        present tensors' updates and of every state leaf, in the state's flattening order."""
        treedef = self.space.param_treedef
        present = [i for i, g in enumerate(grads) if g is not None]
        roles = [Role(i, "grad") for i in present]
        roles += state_roles
        if self.with_params:
            roles += [Role(i, "param") for i in present]
        roles += [Role(None, ("extra", k)) for k in jax.tree.leaves(_keys(self.arrays))]
        roles.append(Role(None, "norm"))
        state_def: Any = jax.tree.structure(state)  # jaxlib's PyTreeDef (no type information)

        def update(g: list[Any], s: Any, p: list[Any] | None, extra: Any, norm: Any) -> Any:
            full = [None] * len(grads)
            for i, x in zip(present, g, strict=True):
                full[i] = x
            g_tree = treedef.unflatten(full)
            p_tree = None
            if p is not None:
                p_full = [None] * len(grads)
                for i, x in zip(present, p, strict=True):
                    p_full[i] = x
                p_tree = treedef.unflatten(p_full)
            norm_args = {} if self.totals else global_norm_args(g_tree, norm)
            u, s = self.inner.update(g_tree, s, p_tree, **extra, **self.others, **norm_args)
            u_leaves = treedef.flatten_up_to(u)
            return [u_leaves[i] for i in present], s

        g = [grads[i] for i in present]
        p = g if self.with_params else None
        nodes, out_def = self.analyser.trace(update, (g, state, p, self.arrays, _NORM), roles)
        if out_def.num_leaves != len(present) + state_def.num_leaves:
            raise ValueError(
                "the inner transformation's update returns a state of another structure than "
                "its init; shard_optimizer needs them to match, as Optax requires"
            )
        return nodes[: len(present)], nodes[len(present) :]

    # -- problems: None when the partition is exact, else one sentence ---------------------

    def _name(self, i: int) -> str:
        return self.space.specs[i].name

    def _leaf(self, k: int) -> str:
        return self.space.leaves[k].name

    def coupling(self) -> str | None:
        """Outputs that read another tensor than their own (any partition)."""
        reason = self.coupled_reason()
        if reason is None:
            return None
        return (
            f"shard_optimizer cannot shard this optimizer exactly: its {reason}, i.e. it "
            "combines all parameters (a global norm, an all-finite test or a shared step-size "
            f"estimate) while each device holds only its share; {_FIX}"
        )

    def coupled_reason(self) -> str | None:
        """``"update of 'b' reads parameter 'w'"``: the first output that reads another
        tensor than its own, or None."""
        for i, node in enumerate(self.updates):
            if node.deps - {i}:
                return self._coupled(f"update of {self._name(i)!r}", node, {i})
        for k, node in enumerate(self.state):
            own = self.space.leaves[k].param
            allowed = set() if own is None else {own}
            if node.deps - allowed:
                what = f"new state leaf {self._leaf(k)!r}"
                if own is None:
                    what += " (shared by all parameters)"
                return self._coupled(what, node, allowed)
        return None

    def _coupled(self, what: str, node: Node, allowed: set[int]) -> str:
        other = self._name(min(node.deps - allowed))
        return f"{what}{self.where} reads parameter {other!r}"

    def greedy_problem(self, layout: GreedyLayout) -> str | None:
        """Why running ``inner`` on each device's owned subtree is not exact, or None."""
        key: tuple[Any, ...] = ("greedy", tuple(tuple(owned) for owned in layout.owned))
        key += tuple(device.sources for device in layout.devices)
        if key not in self._problems:
            self._problems[key] = self._greedy_problem(layout)
        return self._problems[key]

    def _greedy_problem(self, layout: GreedyLayout) -> str | None:
        problem = self.coupling()
        if problem:
            return problem
        specs = self.specs
        for d, device in enumerate(layout.devices):
            owned = set(layout.owned[d])
            grads = [s if i in owned else None for i, s in enumerate(specs)]
            state = jax.eval_shape(self.inner.init, self.space.param_treedef.unflatten(grads))
            roles = [
                Role(self.space.leaves[index].param, self._label_of(index))
                for _, index in device.sources
            ]
            updates, new_state = self._trace(grads, state, roles)
            for i, node in zip(sorted(owned), updates, strict=True):
                if node.deps - {i} or node.sig != self.updates[i].sig:
                    return self._differs(f"update of {self._name(i)!r}")
            for (_, index), node in zip(device.sources, new_state, strict=True):
                own = self.space.leaves[index].param
                allowed = set() if own is None else {own}
                if node.deps - allowed or node.sig != self.state[index].sig:
                    return self._differs(f"new state leaf {self._leaf(index)!r}")
        return None

    def _differs(self, what: str) -> str:
        return (
            f"shard_optimizer cannot use partition='greedy' for this optimizer: given only the "
            f"parameters one device owns, it computes the {what} differently than on the whole "
            "tree (it depends on the other parameters' number, shapes or order, e.g. one PRNG "
            "key split per leaf); use partition='auto' or 'gathered'"
        )

    def flat_problem(self, layout: FlatLayout) -> str | None:
        """Why running ``inner`` on 1-D bucket chunks (``by_param``: on each parameter's
        element range, in a parameter-shaped tree) is not exact (a ``not_elementwise``
        reason), or None. Call ``coupling`` first."""
        if layout.by_param:
            key: Hashable = ("by_param", *(layout.segment_shape(i) for i in range(len(self.specs))))
        else:
            chunks = tuple(
                (layout.chunk(b), str(bucket.dtype))
                for b, bucket in enumerate(layout.buckets.buckets)
            )
            elements = tuple(sorted(layout.element_leaves.items()))
            key = ("buckets", chunks, layout.sources, layout.slots, elements)
        if key not in self._problems:
            self._problems[key] = self._flat_problem(layout)
        return self._problems[key]

    def _flat_problem(self, layout: FlatLayout) -> str | None:
        if layout.by_param:
            return self._by_param_problem(layout)
        chunks = [
            jax.ShapeDtypeStruct((layout.chunk(b),), bucket.dtype)
            for b, bucket in enumerate(layout.buckets.buckets)
        ]
        state = jax.eval_shape(self.inner.init, tuple(chunks))
        flat_paths = jax.tree_util.tree_flatten_with_path(state)[0]
        roles, targets = [], []  # targets: per state leaf, the space leaves it must equal
        for (path, _), (kind, index, bucket) in zip(flat_paths, layout.sources, strict=True):
            if kind == "global":
                roles.append(Role(None, self._label_of(index)))
                targets.append([index])
                continue
            prefix = ".".join(path_parts(path)[:-1])
            roles.append(Role(bucket, ("state", prefix)))
            targets.append([layout.element_leaves[(index, i)] for i, _ in layout.slots[bucket]])
        updates, new_state = self._chunk_trace(chunks, state, roles)
        for b, node in enumerate(updates):
            for i, _ in layout.slots[b]:
                reason = self._flat_reason(node, b, self.updates[i], f"update of {self._name(i)!r}")
                if reason:
                    return reason
        for (kind, _, bucket), node, leaves in zip(layout.sources, new_state, targets, strict=True):
            for k in leaves:
                own = None if kind == "global" else bucket
                reason = self._flat_reason(
                    node, own, self.state[k], f"state leaf {self._leaf(k)!r}"
                )
                if reason:
                    return reason
        return None

    def _by_param_problem(self, layout: FlatLayout) -> str | None:
        segments = [
            jax.ShapeDtypeStruct(layout.segment_shape(i), spec.dtype)
            for i, spec in enumerate(self.specs)
        ]
        state = jax.eval_shape(self.inner.init, self.space.param_treedef.unflatten(segments))
        roles = [Role(leaf.param, self._label_of(k)) for k, leaf in enumerate(self.space.leaves)]
        updates, new_state = self._trace(segments, state, roles)
        return self._per_tensor_problem(updates, new_state, "a flat chunk")

    def rows_problem(
        self, local: Any, aligned: Sequence[bool], geometry: Sequence[Hashable]
    ) -> str | None:
        """Why running ``inner`` on each device's rows of every tensor, with its whole-tensor
        reductions all-reduced (``zero3_step``), is not exact (a ``not_elementwise``
        reason), or None. Needs ``totals=True``; call ``coupled_reason`` first.

        Args:
            local: the parameter tree of one device's rows (``ShapeDtypeStruct`` leaves).
            aligned: per state leaf, whether it is laid out like its parameter's rows.
            geometry: per tensor, what decides where its rows are padding: a total may
                reduce several tensors together only where these are equal.
        """
        leaves = self.space.param_treedef.flatten_up_to(local)
        state = jax.eval_shape(self.inner.init, local)
        roles = [
            Role(leaf.param, self._label_of(k), aligned=ok)
            for k, (leaf, ok) in enumerate(zip(self.space.leaves, aligned, strict=True))
        ]
        updates, new_state = self._trace(leaves, state, roles)
        if reason := self._mixed_rows(geometry):
            return reason
        return self._per_tensor_problem(updates, new_state, "a device's rows")

    def init_rows_problem(self, local: Any, geometry: Sequence[Hashable]) -> str | None:
        """As ``rows_problem`` for ``inner.init`` run on each device's rows (``local``)."""
        whole = self._init_trace(self.params)
        state = self._init_trace(local)
        if reason := self._mixed_rows(geometry):
            return reason
        for k, node in enumerate(state):
            what = f"initial state leaf {self._leaf(k)!r}"
            own = self.space.leaves[k].param
            reason = self._flat_reason(node, own, whole[k], what, "a device's rows")
            if reason:
                return reason
        return None

    def _init_trace(self, params: Any) -> list[Node]:
        treedef = self.space.param_treedef
        leaves = treedef.flatten_up_to(params)
        roles = [Role(i, "param") for i in range(len(leaves))]
        nodes, _ = self.analyser.trace(
            lambda p: self.inner.init(treedef.unflatten(p)), (leaves,), roles
        )
        return nodes

    def _mixed_rows(self, geometry: Sequence[Hashable]) -> str | None:
        """A total of the last trace that reduces tensors padded differently together."""
        for deps in self.analyser.totals.values():
            if len({geometry[t] for t in deps}) > 1:
                names = sorted(self._name(t) for t in deps)[:2]
                return (
                    f"reduces parameters {names[0]!r} and {names[1]!r} together, whose rows "
                    "are padded differently on the devices"
                )
        return None

    def _per_tensor_problem(self, updates: list[Node], new_state: list[Node], piece: str) -> Any:
        """The first output of a per-tensor trace that is not elementwise in its own tensor
        or not computed as on the whole tree (``piece``: what the trace ran on)."""
        for i, node in enumerate(updates):
            what = f"update of {self._name(i)!r}"
            reason = self._flat_reason(node, i, self.updates[i], what, piece)
            if reason:
                return reason
        for k, node in enumerate(new_state):
            what = f"state leaf {self._leaf(k)!r}"
            own = self.space.leaves[k].param
            reason = self._flat_reason(node, own, self.state[k], what, piece)
            if reason:
                return reason
        return None

    def _chunk_trace(
        self, chunks: list[Any], state: Any, state_roles: list[Role]
    ) -> tuple[list[Node], list[Node]]:
        roles = [Role(b, "grad") for b in range(len(chunks))] + state_roles
        if self.with_params:
            roles += [Role(b, "param") for b in range(len(chunks))]
        roles += [Role(None, ("extra", k)) for k in jax.tree.leaves(_keys(self.arrays))]
        roles.append(Role(None, "norm"))

        def update(g: Any, s: Any, p: Any, extra: Any, norm: Any) -> Any:
            norm_args = global_norm_args(g, norm)
            return self.inner.update(g, s, p, **extra, **self.others, **norm_args)

        g = tuple(chunks)
        p = g if self.with_params else None
        nodes, _ = self.analyser.trace(update, (g, state, p, self.arrays, _NORM), roles)
        return nodes[: len(chunks)], nodes[len(chunks) :]

    def _flat_reason(
        self, node: Node, own: int | None, whole: Node, what: str, piece: str = "a flat chunk"
    ) -> str | None:
        # A global leaf that reads no tensor (a count, Muon's ns_coeffs constant) is the same
        # on every device, whatever operations make it.
        shared = own is None and not node.deps
        if node.deps - ({own} if own is not None else set()) or (
            node.kind not in (ELEMENT, UNIFORM) and not shared
        ):
            culprit = node.culprit or "an operation across elements"
            return f"computes the {what}{self.where} with {culprit}, which is not elementwise"
        if node.sig != whole.sig:
            return (
                f"computes the {what}{self.where} differently on {piece} than on the "
                "tensor itself (a mask, label, hyper-parameter or rule chosen per tensor)"
            )
        return None

    def _label_of(self, index: int) -> Any:
        leaf = self.space.leaves[index]
        return _label(leaf.param, leaf.prefix, leaf.name)


def _label(param: int | None, prefix: str, name: str) -> Any:
    return ("global", name) if param is None else ("state", prefix)


def _keys(tree: dict[str, Any]) -> Any:
    """The key of every array leaf of the extra arguments, in flattening order."""
    return {k: jax.tree.map(lambda _, k=k: k, v) for k, v in tree.items()}


class _Same:
    """A key part equal only to the very object it holds. Holding it keeps the object alive,
    so its ``id`` cannot be reused by another; an equal rebuilt object is another key."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Same) and other.obj is self.obj


# The last analyses: ``shard_optimizer`` plans per partition and per call, and the same
# optimizer is often planned several times (partition "auto" after a refused "flat", a rebuilt
# step); the whole-tree trace and every layout's trace then run once. Bounded: each entry holds
# its transformation (a few closures) and the Nodes of its traces.
_CAPACITY = 32
_ANALYSES: OrderedDict[Hashable, Soundness | None] = OrderedDict()
_LOCK = threading.Lock()


def analysed(
    given: Any,
    inner: optax.GradientTransformationExtraArgs,
    space: ModelSpace,
    params: Any,
    probe: dict[str, Any],
    *,
    where: str = "",
) -> Soundness | None:
    """``Soundness(inner, space, params, probe, where=where)``, or ``None`` if the update
    cannot be traced so (it raises); the last ``_CAPACITY`` answers are kept.

    ``given`` is the transformation ``inner`` wraps (``optax.with_extra_args_support``
    builds a new wrapper on every call): keyed by that very object, held, so the answer is
    for the same ``init`` and ``update`` functions (JAX's own trace caches key on the
    function in the same way), plus everything else the analysis reads: the parameter
    tree's structure, shapes and dtypes (``space`` follows from it and ``inner``), the
    probe's shapes and dtypes (arrays only) and ``where``."""
    arrays, others = split_extra_args(probe)
    if others:  # a value_fn: not a key (the analysis closes over it); not cached
        return _analysis(inner, space, params, probe, where)
    key = (_Same(given), signature(params), signature(arrays), where)
    with _LOCK:
        if key in _ANALYSES:
            _ANALYSES.move_to_end(key)
            return _ANALYSES[key]
    soundness = _analysis(inner, space, params, probe, where)
    with _LOCK:
        _ANALYSES[key] = soundness
        while len(_ANALYSES) > _CAPACITY:
            _ANALYSES.popitem(last=False)
    return soundness


def _analysis(
    inner: optax.GradientTransformationExtraArgs,
    space: ModelSpace,
    params: Any,
    probe: dict[str, Any],
    where: str,
) -> Soundness | None:
    try:
        return Soundness(inner, space, params, probe, where=where)
    except Exception:  # needs the real tree (a label tree) or other extra arguments
        return None


# A small tree to refuse a coupling (or, for "flat", non-elementwise) optimizer already when
# shard_optimizer is called; init repeats the analysis on the real tree.
_SAMPLE = {
    "w": jax.ShapeDtypeStruct((5, 4), np.float32),
    "b": jax.ShapeDtypeStruct((7,), np.float32),
}
_ON_SAMPLE = " (on a sample tree of two tensors 'w' and 'b')"


def check_on_sample(
    given: Any, inner: optax.GradientTransformationExtraArgs, partition: str
) -> None:
    """Refuse ``inner`` early if it couples tensors (or, for ``"flat"``, is not elementwise)
    on a small sample tree; one it cannot run on is left to ``init`` on the real tree.
    ``"auto"`` and ``"gathered"`` refuse nothing: a coupled update runs gathered.
    ``given``: the transformation ``inner`` wraps (the analysis cache's key; ``analysed``)."""
    if partition not in ("greedy", "flat"):
        return
    try:
        space = model_space(inner, _SAMPLE)
    except Exception:  # needs the real tree (a label tree)
        return
    soundness = analysed(given, inner, space, _SAMPLE, {}, where=_ON_SAMPLE)
    if soundness is None:
        return
    if problem := soundness.coupling():
        raise ValueError(problem)
    if partition == "flat":
        if keeps_muon_state(inner, _SAMPLE):
            raise not_elementwise(MUON_REASON)
        layout, reason = flat_layout(soundness, inner, space, 2, 1 << 20)
        if layout is None:
            raise not_elementwise(reason)


def flat_layout(
    soundness: Soundness | None,
    inner: optax.GradientTransformationExtraArgs,
    space: ModelSpace,
    n: int,
    cap_bytes: int,
    *,
    by_param_first: bool = False,
    **ordered: Any,
) -> tuple[FlatLayout | None, str]:
    """The flat layout proven exact: gradient buckets, else one bucket per parameter (a mask
    or label per parameter); ``by_param_first``: the other way round. ``(None, reason)`` if
    neither is. Unproven (``soundness`` None: the update needs extra arguments): the first
    that can be built, checked at the first trace."""
    reason = ""
    for by_param in (True, False) if by_param_first else (False, True):
        try:
            layout = build_flat(inner, space, n, cap_bytes, by_param=by_param, **ordered)
        except NotElementwiseError as err:  # the bucket layout's reason is the one to give
            reason = err.reason if not by_param else reason or err.reason
            continue
        if soundness is None:
            return layout, ""
        problem = soundness.flat_problem(layout)
        if problem is None:
            return layout, ""
        reason = problem if not by_param else reason or problem
    return None, reason
