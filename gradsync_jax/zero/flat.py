"""Flat partition: element ranges of gradient buckets (ZeRO-2 style, docs/design.md §4).

The parameters are laid out in ``gradsync_core.plan_buckets`` buckets padded to a multiple of
``N``; device ``i`` owns chunk ``i`` of every bucket (``plan_flat_shards``), which is exactly
what ``lax.psum_scatter(tiled=True)`` leaves on it. One step per bucket: one reduce-scatter,
the inner update on the flat chunk, one all-gather. The inner transformation sees 1-D chunks
that cut through parameters, so the result equals the unsharded one only for elementwise
optimizers; ``soundness.Soundness.flat_problem`` refuses the others from the jaxpr of the
update before any state is built.

A mask or label chosen per parameter (``optax.adamw(mask=...)``, ``optax.masked``,
``optax.multi_transform`` by path, frozen parameters through ``optax.set_to_zero``) cannot
be decided on a chunk that cuts through several parameters. ``by_param=True`` plans one
bucket per parameter instead (``plan_buckets`` with a one-byte cap), so device ``i`` holds
element range ``i`` of every parameter, and hands the inner transformation a tree shaped like
the parameters (same paths; each leaf this device's range, as ``(1, ..., 1, chunk)`` so it
keeps the parameter's rank): the mask or label function then decides as it does on the whole
tree, which the analysis checks (equal signatures), and the state keeps flat's balance (each
parameter padded to a multiple of ``N`` elements at most). The small parameters' buckets
share one reduce-scatter and one all-gather (``wire.py``); what each device stores is
unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax
from jax.sharding import PartitionSpec as P

from gradsync_core import BucketPlan, ShardPlan, plan_buckets, plan_flat_shards
from gradsync_core.plan import plan_param_buckets
from gradsync_jax._axes import cast_varying, tracks_variance, varying
from gradsync_jax._naming import registration_order
from gradsync_jax.zero import wire
from gradsync_jax.zero.clip import global_norm_args
from gradsync_jax.zero.layout import (
    Collective,
    UpdateInputs,
    UpdateResult,
    ZeroState,
    materialize,
)
from gradsync_jax.zero.model_space import ModelSpace, dtype_name, itemsize, key_part, path_parts


class NotElementwiseError(ValueError):
    """The inner transformation cannot be sharded by element ranges exactly."""

    reason: str = ""  # what the inner transformation does (the sentence's middle)


def not_elementwise(reason: str) -> NotElementwiseError:
    err = _not_elementwise(reason)
    err.reason = reason
    return err


def _not_elementwise(reason: str) -> NotElementwiseError:
    return NotElementwiseError(
        f"partition='flat' cuts parameters into element ranges, which is exact only for "
        f"elementwise optimizers (SGD, Adam, AdamW, Lion, RMSProp, ...), but the inner "
        f"transformation {reason}; use partition='greedy', which gives each device whole "
        "parameters and works with every optimizer"
    )


class FlatSlot(NamedTuple):
    """Where a parameter sits in its bucket."""

    param: int  # parameter leaf index
    offset: int  # elements from the bucket start


class FlatSource(NamedTuple):
    """Where one leaf of the flat inner state comes from."""

    kind: str  # "global" (count, hyper-parameters) or "element" (mu, nu: one bucket's chunk)
    index: int  # type: ignore[assignment]  # "global": index into space.leaves; "element":
    # the state prefix's id (the field shadows tuple.index, as a NamedTuple field may)
    bucket: int  # "element": the bucket; -1 for "global"


@dataclass(frozen=True, slots=True, kw_only=True)
class FlatLayout:
    """Implements ``Layout``: device ``i`` holds chunk ``i`` of every bucket's state."""

    space: ModelSpace
    n: int
    plan: ShardPlan
    buckets: BucketPlan
    slots: tuple[tuple[FlatSlot, ...], ...]  # per bucket, in slot order
    state_treedef: Any  # of inner.init(chunks): a tuple of 1-D chunks, one per bucket
    sources: tuple[FlatSource, ...]  # per inner leaf
    element_leaves: dict[tuple[int, int], int]  # (prefix id, param leaf) -> space index
    state_dtypes: tuple[str, ...]  # per inner leaf
    # One parameter per bucket, the inner transformation run on a tree shaped like the
    # parameters (module docstring); False: on the tuple of bucket chunks.
    by_param: bool = False

    def chunk(self, bucket: int) -> int:
        return self.buckets.buckets[bucket].numel // self.n

    def segment_shape(self, i: int) -> tuple[int, ...]:
        """Parameter ``i``'s element range on one device as the inner update sees it
        (``by_param``): the chunk, shaped ``(1, ..., 1, chunk)`` to keep the parameter's rank."""
        rank = max(1, len(self.space.specs[i].shape))
        return (1,) * (rank - 1) + (self.chunk(self._bucket_of(i)),)

    def _bucket_of(self, i: int) -> int:
        return next(b for b, slots in enumerate(self.slots) if slots[0].param == i)

    def view(self, chunks: Sequence[Any]) -> Any:
        """One device's bucket chunks as the inner transformation takes them."""
        if not self.by_param:
            return tuple(chunks)
        leaves = [None] * len(self.space.specs)
        for b, slots in enumerate(self.slots):
            leaves[slots[0].param] = chunks[b].reshape(self.segment_shape(slots[0].param))
        return self.space.param_treedef.unflatten(leaves)

    def unview(self, tree: Any) -> list[Any]:
        """The inner transformation's output (``view``'s structure) -> 1-D chunks per bucket."""
        if not self.by_param:
            return list(tree)
        leaves = self.space.param_treedef.flatten_up_to(tree)
        return [leaves[slots[0].param].reshape(-1) for slots in self.slots]

    def inner_state(self, stored: Any, *, to_inner: bool) -> Any:
        """The stored state (per-element leaves 1-D) <-> the inner transformation's own
        (``by_param``: each per-element leaf shaped like its parameter's segment)."""
        if not self.by_param:
            return stored
        leaves = self.state_treedef.flatten_up_to(stored)
        out = []
        for leaf, (kind, _, bucket) in zip(leaves, self.sources, strict=True):
            if kind == "element":
                shape = self.segment_shape(self.slots[bucket][0].param) if to_inner else (-1,)
                leaf = leaf.reshape(shape)
            out.append(leaf)
        return self.state_treedef.unflatten(out)

    def state_specs(self, spec_entry: Any) -> ZeroState:
        leaves = [P(spec_entry) if s.kind == "element" else P() for s in self.sources]
        return ZeroState(inner=self.state_treedef.unflatten(leaves), shards={})

    def local_shapes(self) -> list[tuple[int, ...]]:
        """The shape of every inner state leaf on one device (inside ``shard_map``)."""
        return [
            (self.chunk(bucket),) if kind == "element" else self.space.leaves[index].shape
            for kind, index, bucket in self.sources
        ]

    def nbytes_per_device(self) -> int:
        total = 0
        for (kind, index, bucket), dtype in zip(self.sources, self.state_dtypes, strict=True):
            total += itemsize(dtype) * (
                self.chunk(bucket) if kind == "element" else self.space.leaves[index].numel
            )
        return total

    def init_sharded(self) -> bool:
        return True

    def init_inputs(self, leaves: list[Any]) -> list[jax.Array]:
        return self._flat(leaves)

    def _flat(self, leaves: list[Any], *, computed: bool = False) -> list[jax.Array]:
        """Per bucket, the parameters' values in slot order, zero-padded (a full copy).

        ``computed``: the leaves are made by the step (gradients), so each bucket's leaves
        are ``materialize``d first and the concatenate only copies them.
        """
        out = []
        for b, bucket in enumerate(self.buckets.buckets):
            members = [leaves[i] for i, _ in self.slots[b]]
            if computed:
                members = materialize(members)
            parts = [leaf.ravel().astype(bucket.dtype) for leaf in members]
            pad = bucket.numel - sum(int(p.size) for p in parts)
            if pad:
                parts.append(jnp.zeros(pad, bucket.dtype))
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return out

    def _own_chunks(self, leaves: list[Any], axes: tuple[str, ...]) -> tuple[jax.Array, ...]:
        """This device's chunk of every bucket of ``leaves`` (the replicated parameters).

        Slicing ``_flat(leaves)`` at the device index would concatenate every bucket whole
        each step (the parameters do not change shape, only value): N times the bytes this
        device reads. Each ``lax.switch`` branch instead copies only the element ranges of
        the parameters that fall in its own chunk (static slices), 1/N of them.
        """

        def branch(d: int) -> Any:
            def run(leaves: list[Any]) -> Any:
                return cast_varying(
                    tuple(self._chunk_of(leaves, b, d) for b in range(len(self.slots))), axes
                )

            return run

        return lax.switch(lax.axis_index(axes), [branch(d) for d in range(self.n)], leaves)

    def _chunk_of(self, leaves: list[Any], b: int, d: int) -> jax.Array:
        """Elements ``[d * chunk, (d + 1) * chunk)`` of bucket ``b`` (zeros where padded)."""
        dtype = self.buckets.buckets[b].dtype
        lo, hi = d * self.chunk(b), (d + 1) * self.chunk(b)
        parts, at = [], lo
        for i, offset in self.slots[b]:
            a, z = max(lo, offset), min(hi, offset + self.space.specs[i].numel)
            if a >= z:
                continue
            if a > at:  # alignment gap between slots
                parts.append(jnp.zeros(a - at, dtype))
            parts.append(leaves[i].ravel()[a - offset : z - offset].astype(dtype))
            at = z
        if hi > at:
            parts.append(jnp.zeros(hi - at, dtype))
        return parts[0] if len(parts) == 1 else jnp.concatenate(parts)

    # -- inside shard_map ------------------------------------------------------------------

    def init_local(
        self, inner: optax.GradientTransformation, inputs: list[Any], axes: tuple[str, ...]
    ) -> ZeroState:
        state = inner.init(self.view(inputs))
        return ZeroState(inner=self.inner_state(state, to_inner=False), shards={})

    def update_local(
        self,
        inner: optax.GradientTransformationExtraArgs,
        inputs: UpdateInputs,
        group: Collective,
    ) -> UpdateResult:
        axes, params = group.axes, inputs.params
        flats = self._flat(inputs.grads, computed=True)
        g_chunks = wire.reduce_scatter(flats, self.wire_groups(), axes, self.n, group.mean)
        p_chunks = None if params is None else self._own_chunks(params, axes)
        norm = jnp.sqrt(lax.psum(sum(jnp.sum(jnp.square(g)) for g in g_chunks), axes))
        g_view = self.view(g_chunks)
        u_view, inner_state = inner.update(
            g_view,
            self.inner_state(inputs.state.inner, to_inner=True),
            None if p_chunks is None else self.view(p_chunks),
            **inputs.extra_args,
            **global_norm_args(g_view, norm),
        )
        u_chunks = self.unview(u_view)
        inner_state = self.inner_state(inner_state, to_inner=False)
        if tracks_variance(axes):  # a global leaf computed from this device's chunk only
            leaves = self.state_treedef.flatten_up_to(inner_state)
            for (kind, index, _), leaf in zip(self.sources, leaves, strict=True):
                if kind == "global" and set(axes) & varying(leaf):
                    raise not_elementwise(
                        f"computes its state leaf {self.space.leaves[index].name!r} from the "
                        "gradient as a whole"
                    )
        updates: list[Any] = [None] * len(self.space.specs)
        for b, full in enumerate(wire.all_gather(u_chunks, self.wire_groups(), axes, self.n)):
            for i, offset in self.slots[b]:
                spec = self.space.specs[i]
                updates[i] = full[offset : offset + spec.numel].reshape(spec.shape)
        updates = [  # a zero-size parameter gets a zero-size update
            jnp.zeros(spec.shape, spec.dtype) if u is None else u
            for spec, u in zip(self.space.specs, updates, strict=True)
        ]
        return UpdateResult(updates=updates, state=ZeroState(inner=inner_state, shards={}))

    def wire_groups(self) -> wire.Groups:
        """The buckets that travel in one collective (``wire.wire_groups``): under
        ``by_param`` the small ones share one; the stored layout is the same either way."""
        return wire.wire_groups(self.buckets.buckets, pack=self.by_param)

    # -- host side: model space <-> storage ------------------------------------------------

    def gather(self, state: ZeroState) -> list[np.ndarray]:
        values = [np.asarray(x) for x in self.state_treedef.flatten_up_to(state.inner)]
        out: list[Any] = [None] * len(self.space.leaves)
        for (kind, index, bucket), value in zip(self.sources, values, strict=True):
            if kind == "global":
                out[index] = value
                continue
            for i, offset in self.slots[bucket]:
                leaf_index = self.element_leaves[(index, i)]
                leaf = self.space.leaves[leaf_index]
                out[leaf_index] = value[offset : offset + leaf.numel].reshape(leaf.shape)
        for k, leaf in enumerate(self.space.leaves):
            if out[k] is None:  # zero-size parameter
                out[k] = np.zeros(leaf.shape, leaf.dtype)
        return out

    def scatter(self, leaves: list[np.ndarray]) -> ZeroState:
        values = []
        for (kind, index, bucket), dtype in zip(self.sources, self.state_dtypes, strict=True):
            if kind == "global":
                values.append(np.asarray(leaves[index]))
                continue
            flat = np.zeros(self.buckets.buckets[bucket].numel, dtype)
            for i, offset in self.slots[bucket]:
                leaf_index = self.element_leaves[(index, i)]
                value = np.ravel(leaves[leaf_index])
                flat[offset : offset + value.size] = value
            values.append(flat)
        return ZeroState(inner=self.state_treedef.unflatten(values), shards={})


def build_flat(
    inner: optax.GradientTransformation,
    space: ModelSpace,
    n: int,
    cap_bytes: int,
    *,
    order: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
    by_param: bool = False,
) -> FlatLayout:
    """Plan buckets (padded to a multiple of ``n``) and map the inner state onto them;
    ``order``: the torch registration order (torch names, after ``modules`` renames);
    ``by_param``: one bucket per parameter, the inner update run on a parameter-shaped tree
    (module docstring). Raises ``NotElementwiseError`` for a state it cannot hold."""
    # Torch's registration order, so the plan renamed to torch names is the one
    # ZeroRedundancyOptimizer(shard_gradients=True) makes for the twin module (same owners).
    specs = registration_order(space.specs, order=order, modules=modules)
    if by_param and any(spec.numel == 0 for spec in specs):
        # plan_param_buckets refuses it too; here it must be the refusal auto falls back on
        raise not_elementwise("has a zero-size parameter, which has no element range")
    if by_param:
        buckets = plan_param_buckets(specs, pad_to=n)
    else:
        buckets = plan_buckets(specs, cap_bytes=cap_bytes, pad_to=n)
    position = {spec.name: i for i, spec in enumerate(space.specs)}
    slots = tuple(
        tuple(FlatSlot(position[slot.name], slot.offset) for slot in bucket.slots)
        for bucket in buckets.buckets
    )
    if by_param:
        sources = _StateSources.by_param(inner, space, buckets, slots, n)
    else:
        sources = _StateSources.of(inner, space, buckets, slots, n)
    return FlatLayout(
        by_param=by_param,
        space=space,
        n=n,
        plan=plan_flat_shards(buckets, world_size=n),
        buckets=buckets,
        slots=slots,
        state_treedef=sources.treedef,
        sources=sources.sources,
        element_leaves=sources.element_leaves,
        state_dtypes=sources.dtypes,
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class _StateSources:
    """Where each leaf of ``inner.init(chunks)`` comes from in model space: a global leaf
    (count, hyper-parameters) or one bucket's chunk of a per-parameter state (mu, nu)."""

    treedef: Any
    sources: tuple[FlatSource, ...]
    element_leaves: dict[tuple[int, int], int]  # (prefix id, param leaf) -> space index
    dtypes: tuple[str, ...]

    @classmethod
    def of(
        cls,
        inner: optax.GradientTransformation,
        space: ModelSpace,
        buckets: BucketPlan,
        slots: tuple[tuple[FlatSlot, ...], ...],
        n: int,
    ) -> _StateSources:
        """Raises ``NotElementwiseError`` for a state the flat layout cannot hold."""
        flat, grown, treedef = _chunk_states(inner, buckets, n)
        prefixes, by_prefix_param = _element_leaves(space)
        sources = []
        for (path, leaf), bigger in zip(flat, grown, strict=True):
            parts = path_parts(path)
            joined = "/".join(parts)
            if tuple(leaf.shape) == tuple(bigger.shape):
                if joined not in space.global_by_path:
                    raise not_elementwise(f"keeps a state leaf {joined!r} not tied to elements")
                sources.append(FlatSource("global", space.global_by_path[joined], -1))
                continue
            bucket = int(key_part(path[-1])) if path else -1
            prefix = ".".join(parts[:-1])
            if prefix not in prefixes or tuple(leaf.shape) != (buckets.buckets[bucket].numel // n,):
                raise not_elementwise(f"keeps a state leaf {joined!r} not shaped like its input")
            for i, _ in slots[bucket]:
                k = by_prefix_param.get((prefixes[prefix], i))
                if k is None or space.leaves[k].shape != space.specs[i].shape:
                    raise not_elementwise(
                        f"keeps state {prefix!r} of a shape other than its parameter's"
                    )
            sources.append(FlatSource("element", prefixes[prefix], bucket))
        covered = sum(len(slots[b]) for kind, _, b in sources if kind == "element")
        if covered != len(by_prefix_param):
            raise not_elementwise("keeps per-parameter state that the flat layout cannot hold")
        return cls(
            treedef=treedef,
            sources=tuple(sources),
            element_leaves=by_prefix_param,
            dtypes=tuple(dtype_name(leaf.dtype) for _, leaf in flat),
        )

    @classmethod
    def by_param(
        cls,
        inner: optax.GradientTransformation,
        space: ModelSpace,
        buckets: BucketPlan,
        slots: tuple[tuple[FlatSlot, ...], ...],
        n: int,
    ) -> _StateSources:
        """The sources when each bucket holds one parameter and the inner transformation
        runs on a parameter-shaped tree: its state leaves are the whole tree's, in order."""
        return _tree_sources(inner, space, buckets, slots, n)


def _segments(
    space: ModelSpace, buckets: BucketPlan, slots: tuple[tuple[FlatSlot, ...], ...], n: int
) -> list[jax.ShapeDtypeStruct]:
    """Per parameter, its element range on one device as ``FlatLayout.view`` shapes it."""
    out: list[Any] = [None] * len(space.specs)
    for b, bucket in enumerate(buckets.buckets):
        i = slots[b][0].param
        rank = max(1, len(space.specs[i].shape))
        out[i] = jax.ShapeDtypeStruct((1,) * (rank - 1) + (bucket.numel // n,), bucket.dtype)
    return out


def _init_error(err: Exception, on: str) -> NotElementwiseError:
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
    return not_elementwise(f"cannot be initialized on {on} ({type(err).__name__}: {first_line})")


def _element_leaves(space: ModelSpace) -> tuple[dict[str, int], dict[tuple[int, int], int]]:
    """The per-parameter state prefixes (``mu``, ``nu``) numbered in first-appearance order,
    and the model-space leaf of each (prefix id, parameter). Raises ``NotElementwiseError``
    for several leaves of one prefix per parameter (per-dimension state, as SM3's)."""
    prefixes: dict[str, int] = {}  # space prefix text -> id
    leaves: dict[tuple[int, int], int] = {}
    for k, leaf in enumerate(space.leaves):
        if leaf.param is None:
            continue
        key = (prefixes.setdefault(leaf.prefix, len(prefixes)), leaf.param)
        if key in leaves:
            raise not_elementwise(f"keeps several state leaves {leaf.prefix!r} per parameter")
        leaves[key] = k
    return prefixes, leaves


def _tree_sources(
    inner: optax.GradientTransformation,
    space: ModelSpace,
    buckets: BucketPlan,
    slots: tuple[tuple[FlatSlot, ...], ...],
    n: int,
) -> _StateSources:
    """``_StateSources.by_param``: the inner state of the parameter-shaped tree of segments
    must have the whole tree's structure, each per-parameter leaf its segment's shape."""
    segments = _segments(space, buckets, slots, n)
    try:
        state = jax.eval_shape(inner.init, space.param_treedef.unflatten(segments))
    except Exception as err:
        raise _init_error(err, "each parameter's element range") from err
    leaves, treedef = jax.tree.flatten(state)
    if treedef != space.state_treedef:
        raise not_elementwise("keeps a state whose structure depends on the parameters' shapes")
    bucket_of = {slots[b][0].param: b for b in range(len(slots))}
    prefixes, element_leaves = _element_leaves(space)
    sources = []
    for k, (leaf, value) in enumerate(zip(space.leaves, leaves, strict=True)):
        want = leaf.shape if leaf.param is None else segments[leaf.param].shape
        if tuple(value.shape) != tuple(want):
            raise not_elementwise(f"keeps state {leaf.name!r} of a shape other than its input's")
        if leaf.param is None:
            sources.append(FlatSource("global", k, -1))
        else:
            sources.append(FlatSource("element", prefixes[leaf.prefix], bucket_of[leaf.param]))
    return _StateSources(
        treedef=treedef,
        sources=tuple(sources),
        element_leaves=element_leaves,
        dtypes=tuple(dtype_name(value.dtype) for value in leaves),
    )


def _chunk_states(
    inner: optax.GradientTransformation, buckets: BucketPlan, n: int
) -> tuple[list[tuple[Any, Any]], list[Any], Any]:
    """``inner.init`` of one device's chunks, abstractly, twice: with the chunk length and
    one longer. A leaf whose shape follows the chunk length is per element; one that does
    not (count, hyper-parameters) is global. Two lengths tell them apart even when n == 1.

    Returns the first state's (path, leaf) pairs, the second's leaves and the treedef.
    """

    def chunks(extra: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        return tuple(
            jax.ShapeDtypeStruct((b.numel // n + extra,), b.dtype) for b in buckets.buckets
        )

    try:
        state = jax.eval_shape(inner.init, chunks(0))
        grown = jax.tree.leaves(jax.eval_shape(inner.init, chunks(1)))
    except Exception as err:  # a label or mask tree shaped like the parameters
        raise _init_error(err, "flat 1-D chunks") from err
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    if len(grown) != len(flat):
        raise not_elementwise("has a state whose structure depends on the parameters' sizes")
    return flat, grown, treedef
