"""Row layouts: how each device's differently shaped tensors share ``(N, L)`` buffers.

The greedy partition gives device ``d`` its own list of tensors (optimizer-state leaves,
updates). They are stored in buffers with one row per device, sharded over the axis. Two
layouts, chosen per dtype:

- *slotted*: buffer ``k`` holds every device's k-th largest tensor (padded to the largest of
  them). A row is then one tensor: nothing is copied to pack it. Used when the padding costs
  at most ``slack`` of the packed row, which is the case for stacks of equal layers.
- *packed*: one buffer whose row ``d`` is device ``d``'s tensors concatenated; its length is
  the largest device's share (the imbalance of the plan).
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradsync_jax.zero.layout import ZeroState
from gradsync_jax.zero.model_space import ModelSpace, itemsize, path_parts

Item = tuple[Hashable, str, int]  # (key, dtype name, numel)


@dataclass(frozen=True, slots=True, kw_only=True)
class Rows:
    """Buffers of one row per device and where each tensor sits in its owner's row."""

    n: int
    buffers: tuple[tuple[str, int], ...]  # (dtype, row length) per buffer
    slots: dict[Hashable, tuple[int, int]]  # key -> (buffer, offset in its owner's row)
    members: tuple[tuple[tuple[Hashable, ...], ...], ...]  # [device][buffer] -> keys in order
    numel: dict[Hashable, int]
    dtype: dict[Hashable, str]

    def names(self) -> list[str]:
        """Buffer names for ``ZeroState.shards``: ``"float32"`` or ``"float32/2"``."""
        dtypes = [dtype for dtype, _ in self.buffers]
        out: list[str] = []
        seen: dict[str, int] = {}
        for dtype in dtypes:
            seen[dtype] = seen.get(dtype, -1) + 1
            out.append(dtype if dtypes.count(dtype) == 1 else f"{dtype}/{seen[dtype]}")
        return out

    @property
    def nbytes(self) -> int:
        """Bytes of one row of every buffer: what each device holds."""
        return sum(length * np.dtype(dtype).itemsize for dtype, length in self.buffers)

    def pack(self, d: int, values: Mapping[Any, jax.Array]) -> list[jax.Array]:
        """Device ``d``'s rows (1-D, one per buffer) from its tensors ``values`` by key."""
        out = []
        for b, (dtype, length) in enumerate(self.buffers):
            parts = [values[key].ravel() for key in self.members[d][b]]
            used = sum(int(p.size) for p in parts)
            if length > used:
                parts.append(jnp.zeros(length - used, dtype))
            out.append(parts[0] if len(parts) == 1 else jnp.concatenate(parts))
        return out

    def unpack(
        self, rows: Sequence[Any], key: Hashable, shape: tuple[int, ...], xp: Any = jnp
    ) -> Any:
        """The tensor ``key`` from its owner's rows (1-D arrays, one per buffer); ``xp`` is
        ``jax.numpy`` inside a step, ``numpy`` on the host."""
        if self.numel[key] == 0:  # zero-size tensors take no room
            return xp.zeros(shape, self.dtype[key])
        b, offset = self.slots[key]
        return rows[b][offset : offset + self.numel[key]].reshape(shape)


def plan_rows(per_device: Sequence[Sequence[Item]], *, slack: float = 0.05) -> Rows:
    """Lay out every device's tensors (``per_device[d]``, in order) in row buffers."""
    n = len(per_device)
    numel = {key: size for items in per_device for key, _, size in items}
    dtypes = sorted({dtype for items in per_device for _, dtype, _ in items})
    buffers: list[tuple[str, int]] = []
    slots: dict[Hashable, tuple[int, int]] = {}
    members: list[list[tuple[Hashable, ...]]] = [[] for _ in range(n)]
    for dtype in dtypes:
        lists = [[(key, size) for key, dt, size in items if dt == dtype] for items in per_device]
        packed = max(sum(size for _, size in keys) for keys in lists)
        ranked = [sorted(keys, key=lambda item: -item[1]) for keys in lists]  # stable
        widths = [
            max((keys[k][1] if k < len(keys) else 0) for keys in ranked)
            for k in range(max(len(keys) for keys in ranked))
        ]
        if packed and sum(widths) <= packed * (1 + slack):
            for k, width in enumerate(widths):
                if not width:
                    continue
                for d, keys in enumerate(ranked):
                    member = (keys[k][0],) if k < len(keys) else ()
                    members[d].append(member)
                    for key in member:
                        slots[key] = (len(buffers), 0)
                buffers.append((dtype, width))
        elif packed:
            for d, keys in enumerate(lists):
                offset = 0
                for key, size in keys:
                    slots[key] = (len(buffers), offset)
                    offset += size
                members[d].append(tuple(key for key, size in keys if size))
            buffers.append((dtype, packed))
    return Rows(
        n=n,
        buffers=tuple(buffers),
        slots=slots,
        members=tuple(tuple(m) for m in members),
        numel=numel,
        dtype={key: dtype for items in per_device for key, dtype, _ in items},
    )


def column_cuts(length: int, chunks: int) -> tuple[int, ...]:
    """Boundaries of ``chunks`` (at least 1) near-equal column ranges of ``[0, length)``."""
    chunks = max(1, min(chunks, length))
    return tuple(length * c // chunks for c in range(chunks + 1))


class StateSource(NamedTuple):
    """Where one leaf of a device's inner state is stored."""

    kind: str  # "global" (count, hyper-parameters: replicated) or "param" (a state row)
    index: int  # type: ignore[assignment]  # into space.leaves (shadows tuple.index)


@dataclass(frozen=True, slots=True, kw_only=True)
class DeviceState:
    """How one device's inner state (``inner.init`` of its owned tree) maps to storage."""

    treedef: Any
    sources: tuple[StateSource, ...]  # per leaf of the device's inner state


def map_device_state(
    inner: optax.GradientTransformation, space: ModelSpace, tree: Any, d: int, owner: Any
) -> tuple[DeviceState, list[tuple[int, str, int]]]:
    """Map ``inner.init(tree)`` (device ``d``'s share) onto the unsharded state's leaves."""
    try:
        state = jax.eval_shape(inner.init, tree)
    except Exception as err:  # e.g. galore reads .dtype of every leaf, None included
        raise ValueError(
            f"the inner transformation's init fails on the parameters device {d} owns, with the "
            f"others set to None ({type(err).__name__}: {err}); partition='greedy' needs an "
            "init that skips None leaves, as optax's tree maps do, so run it unsharded"
        ) from err
    flat, treedef = jax.tree_util.tree_flatten_with_path(state)
    sources, items = [], []
    for path, leaf in flat:
        joined = "/".join(path_parts(path))
        if joined in space.global_by_path:
            sources.append(StateSource("global", space.global_by_path[joined]))
            continue
        index = space.param_by_path.get(joined)
        known = None if index is None else space.leaves[index]
        if (
            index is None
            or known is None
            or owner[known.param] != d
            or known.shape != tuple(leaf.shape)
        ):
            raise ValueError(
                f"inner optimizer state leaf {joined!r} of device {d}'s share does not match "
                "the unsharded state; the inner transformation's state must be laid out per "
                "parameter"
            )
        sources.append(StateSource("param", index))
        items.append((index, np.dtype(leaf.dtype).name, known.numel))
    return DeviceState(treedef=treedef, sources=tuple(sources)), items


def globals_tree(space: ModelSpace, global_values: list[Any]) -> Any:
    """The inner state with its global leaves (in order) and ``None`` per-parameter leaves:
    how a partition that keeps per-parameter state in rows holds ``ZeroState.inner``."""
    it = iter(global_values)
    return space.state_treedef.unflatten(
        [next(it) if s.param is None else None for s in space.leaves]
    )


def _host(value: Any) -> Any:
    """A global leaf on the host: NumPy, except a PRNG key (NumPy has no key dtype)."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        return value
    return np.asarray(value)


def gather_owned(space: ModelSpace, rows: Rows, owner: Any, state: Any) -> list[np.ndarray]:
    """Host side: the unsharded state's leaves (NumPy, ``space.leaves`` order) from a
    ``ZeroState`` whose per-parameter leaves sit in their owner's ``rows``."""
    host = [np.asarray(state.shards[name]) for name in rows.names()]
    globals_ = iter(_host(g) for g in jax.tree.leaves(state.inner))
    out = []
    for index, leaf in enumerate(space.leaves):
        if leaf.param is None:
            out.append(next(globals_))
        else:
            owner_rows = [buf[owner[leaf.param]] for buf in host]
            out.append(rows.unpack(owner_rows, index, leaf.shape, np))
    return out


def scatter_owned(space: ModelSpace, rows: Rows, owner: Any, leaves: list[np.ndarray]) -> ZeroState:
    """Host side, the inverse of ``gather_owned``: a ``ZeroState`` of host buffers."""
    host = [np.zeros((rows.n, length), dtype) for dtype, length in rows.buffers]
    for index, (leaf, value) in enumerate(zip(space.leaves, leaves, strict=True)):
        if leaf.param is not None and leaf.numel:
            b, offset = rows.slots[index]
            host[b][owner[leaf.param], offset : offset + leaf.numel] = np.ravel(value)
    globals_ = [leaves[i] for i, leaf in enumerate(space.leaves) if leaf.param is None]
    return ZeroState(
        inner=globals_tree(space, globals_), shards=dict(zip(rows.names(), host, strict=True))
    )


class OwnedRows:
    """What the partitions that store each parameter's state whole in its owner's row share
    (greedy, gathered): specs, shapes, bytes and the host-side conversions. Needs the
    attributes ``space`` (``ModelSpace``), ``state`` (``Rows``) and ``owner``."""

    __slots__ = ()
    space: ModelSpace
    state: Rows
    owner: tuple[int, ...]

    @property
    def globals(self) -> list[int]:
        return [i for i, s in enumerate(self.space.leaves) if s.param is None]

    def state_specs(self, spec_entry: Any) -> ZeroState:
        """Globals replicated, per-parameter leaves ``None``, rows sharded over the axis."""
        inner = globals_tree(self.space, [jax.sharding.PartitionSpec()] * len(self.globals))
        rows = {name: jax.sharding.PartitionSpec(spec_entry) for name in self.state.names()}
        return ZeroState(inner=inner, shards=rows)

    def local_shapes(self) -> list[tuple[int, ...]]:
        """The inner state holds the global leaves only, whole on every device."""
        return [self.space.leaves[i].shape for i in self.globals]

    def init_sharded(self) -> bool:
        return False

    def init_inputs(self, leaves: list[Any]) -> list[Any]:
        return leaves

    def nbytes_per_device(self) -> int:
        leaves = self.space.leaves
        return self.state.nbytes + sum(
            leaves[i].numel * itemsize(leaves[i].dtype) for i in self.globals
        )

    def gather(self, state: ZeroState) -> list[np.ndarray]:
        """The unsharded inner state's leaves (NumPy), in ``space.leaves`` order."""
        return gather_owned(self.space, self.state, self.owner, state)

    def scatter(self, leaves: list[np.ndarray]) -> ZeroState:
        """Unsharded leaves -> inner with globals, and host shard buffers."""
        return scatter_owned(self.space, self.state, self.owner, leaves)
