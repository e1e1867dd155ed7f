"""Model space: the inner Optax state as the unsharded optimizer would hold it.

Both shard partitions convert to and from this form (``gather_state`` / ``scatter_state``),
and checkpoints store it per parameter (docs/design.md §9). A leaf of the inner state is either
*per-parameter* (``mu`` of ``params/Dense_0/kernel``; it sits under that parameter's key path)
or *global* (``count``, injected hyper-parameters): global leaves are exactly those that
``inner.init`` still creates for a tree with every parameter removed.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
import optax

from gradsync_core import ParamSpec
from gradsync_jax._specs import param_specs


def key_part(key: Any) -> str:
    """One key of a key path as text (``mu``, ``0``, ``kernel``)."""
    for attr in ("name", "key", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def path_parts(path: Sequence[Any]) -> tuple[str, ...]:
    return tuple(key_part(k) for k in path)


def pure(tree: Any) -> Any:
    """``tree`` with Flax NNX ``Variable`` leaves replaced by their values.

    ``nnx.Optimizer`` calls ``tx.init`` with ``Param`` variables but ``tx.update`` with plain
    arrays; the state must be built from the same (plain) structure both times.
    """
    try:
        from flax import nnx
    except ImportError:  # flax is optional
        return tree
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    if not any(is_var(x) for x in jax.tree.leaves(tree, is_leaf=is_var)):
        return tree
    return jax.tree.map(lambda x: x.get_value() if is_var(x) else x, tree, is_leaf=is_var)


def dtype_name(dtype: Any) -> str:
    """``"float32"``; JAX's extended dtypes (PRNG keys: ``"key<fry>"``) by their own name."""
    return str(dtype) if jax.dtypes.issubdtype(dtype, jax.dtypes.extended) else np.dtype(dtype).name


def itemsize(dtype: Any) -> int:
    """Bytes per element, PRNG keys included (their key data)."""
    if isinstance(dtype, str) and dtype.startswith("key<"):
        return 8 if dtype == "key<fry>" else 16  # threefry: 2 x uint32; rbg: 4 x uint32
    return np.dtype(dtype).itemsize


def as_dtype(value: Any, dtype: str) -> Any:
    """``value`` as a state leaf's dtype (a PRNG key stays as it is)."""
    value = jax.numpy.asarray(value)
    return value if dtype.startswith("key<") else value.astype(dtype)


def abstract(tree: Any) -> Any:
    """Shapes and dtypes only (works on arrays, tracers and ``ShapeDtypeStruct``)."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), tree)


def signature(tree: Any) -> tuple[Any, ...]:
    """A hashable key of a tree's structure, shapes and dtypes (layout cache key)."""
    leaves, treedef = jax.tree.flatten(tree)
    return (treedef, tuple((tuple(np.shape(x)), dtype_name(x.dtype)) for x in leaves))


@dataclass(frozen=True, slots=True, kw_only=True)
class StateLeaf:
    """One leaf of the unsharded inner state."""

    name: str  # dotted path inside the state, unique: "0.mu.params.Dense_0.kernel"
    shape: tuple[int, ...]
    dtype: str
    param: int | None  # index of the parameter leaf it belongs to; None for a global leaf
    prefix: str  # per-parameter: the state path above the parameter ("0.mu"); global: name
    key: str  # checkpoint state key: "mu" ("<param>/mu"); global: name

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelSpace:
    """The parameters and the unsharded inner state's layout, derived abstractly."""

    param_treedef: Any
    specs: tuple[ParamSpec, ...]  # one per parameter leaf, in flattening order
    state_treedef: Any  # of ``inner.init(params)``
    leaves: tuple[StateLeaf, ...]  # in the state's flattening order
    global_by_path: dict[str, int]  # "/"-joined path -> index into ``leaves``
    param_by_path: dict[str, int]  # "/"-joined path -> index into ``leaves``
    # The Optax state types of ``inner.init`` without parameters ("ScaleByAdamState",
    # "EmptyState"): what names the optimizer in a checkpoint (gradsync_jax.checkpoint).
    state_types: tuple[str, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.specs)


def _not_per_parameter(name: str) -> ValueError:
    return ValueError(
        f"inner optimizer state leaf {name!r} belongs to no single parameter (its key path "
        "does not end with a parameter's path); shard_optimizer needs the state laid out per "
        "parameter, as every Optax transformation built with tree maps over the parameters is"
    )


def _owners(
    flat: list[tuple[Any, Any]], global_paths: dict[str, Any], by_parts: dict[tuple[str, ...], int]
) -> list[tuple[tuple[str, ...], Any, int | None, tuple[str, ...], tuple[str, ...]]]:
    """Each state leaf as ``(parts, leaf, parameter index or None, prefix parts, suffix
    parts)``; the suffix is what follows the parameter's path (SM3 keeps one accumulator per
    dimension of a tensor: ``mu/<param>/0``, ``mu/<param>/1``)."""
    raw: list[tuple[tuple[str, ...], Any, int | None, tuple[str, ...], tuple[str, ...]]] = []
    for path, leaf in flat:
        parts = path_parts(path)
        joined = "/".join(parts)
        if joined in global_paths:
            if tuple(global_paths[joined].shape) != tuple(leaf.shape):
                raise _not_per_parameter(".".join(parts))
            raw.append((parts, leaf, None, parts, ()))
            continue
        # The longest suffix that is a parameter path: params {"a": {"b": x}, "b": y} put
        # mu of x at (..., "a", "b"), whose suffix ("b",) alone would name y. Failing that,
        # a parameter path followed by per-tensor sub-leaves (SM3), the longest again.
        found = _param_in(parts, by_parts)
        if found is None:
            raise _not_per_parameter(".".join(parts))
        cut, end = found
        raw.append((parts, leaf, by_parts[parts[cut:end]], parts[:cut], parts[end:]))
    return raw


def _param_in(parts: tuple[str, ...], by_parts: dict[tuple[str, ...], int]) -> Any:
    """``(cut, end)`` with ``parts[cut:end]`` a parameter path: ``end`` the last possible,
    then the longest; ``None`` if no parameter path occurs."""
    for end in range(len(parts), 0, -1):
        for cut in range(end):
            if parts[cut:end] in by_parts:
                return cut, end
    return None


def model_space(inner: optax.GradientTransformation, params: Any) -> ModelSpace:
    """Analyse ``inner``'s state for ``params`` (any arrays or ``ShapeDtypeStruct``)."""
    params = abstract(params)
    param_treedef: Any  # jaxlib's PyTreeDef (no type information installed)
    leaves_with_paths, param_treedef = jax.tree_util.tree_flatten_with_path(params)
    specs = tuple(param_specs(params))
    by_parts = {path_parts(path): i for i, (path, _) in enumerate(leaves_with_paths)}
    full = jax.eval_shape(inner.init, params)
    empty = jax.eval_shape(inner.init, param_treedef.unflatten([None] * param_treedef.num_leaves))
    global_paths = {
        "/".join(path_parts(p)): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(empty)[0]
    }
    flat, state_treedef = jax.tree_util.tree_flatten_with_path(full)
    raw = _owners(flat, global_paths, by_parts)
    prefixes = {".".join(pre) for _, _, p, pre, _ in raw if p is not None}
    lasts = {pre.rpartition(".")[2] for pre in prefixes}
    short = len(lasts) == len(prefixes) and "" not in lasts  # "mu", "nu" unless ambiguous
    leaves = []
    for parts, leaf, param, prefix, suffix in raw:
        name = ".".join(parts)
        pre = ".".join(prefix)
        key = pre if param is None else (pre.rpartition(".")[2] if short else pre)
        if suffix:  # one tensor's sub-leaves: "mu.0", "mu.1"
            key = ".".join((key, *suffix))
        leaves.append(
            StateLeaf(
                name=name,
                shape=tuple(int(d) for d in leaf.shape),
                dtype=dtype_name(leaf.dtype),
                param=param,
                prefix=pre,
                key=key,
            )
        )
    names = [leaf.name for leaf in leaves]
    if len(set(names)) != len(names):
        raise ValueError("two inner optimizer state leaves have the same dotted path")
    return ModelSpace(
        param_treedef=param_treedef,
        specs=specs,
        state_treedef=state_treedef,
        leaves=tuple(leaves),
        global_by_path={
            "/".join(path_parts(p)): i for i, (p, _) in enumerate(flat) if leaves[i].param is None
        },
        param_by_path={
            "/".join(path_parts(p)): i
            for i, (p, _) in enumerate(flat)
            if leaves[i].param is not None
        },
        state_types=tuple(re.findall(r"namedtuple\[(\w+)\]", str(jax.tree.structure(empty)))),
    )
