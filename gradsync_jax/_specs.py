"""ParamSpecs from a JAX pytree: the only place JAX facts enter the planner."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from gradsync_core import ParamSpec


def path_name(path: tuple[Any, ...]) -> str:
    """A key path as a slash-joined name: ``params/Dense_0/kernel`` (Flax's own spelling)."""
    parts = []
    for key in path:
        if isinstance(key, jax.tree_util.DictKey):
            parts.append(str(key.key))
        elif isinstance(key, jax.tree_util.GetAttrKey):
            parts.append(key.name)
        elif isinstance(key, jax.tree_util.SequenceKey):
            parts.append(str(key.idx))
        else:
            parts.append(str(getattr(key, "key", key)))
    return "/".join(parts)


def leaf_names(
    tree: Any, names: Sequence[str] | None = None, *, label: str = "the tree"
) -> list[str]:
    """The plan name of every leaf of ``tree`` in flattening order: ``names`` when given
    (checked against the leaf count; ``label`` names ``tree`` in the error), else the
    ``path_name`` of each key path.

    Raises:
        ValueError: if ``names`` has another length than ``tree`` has leaves.
    """
    paths_leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    if names is None:
        return [path_name(path) for path, _ in paths_leaves]
    if len(names) != len(paths_leaves):
        raise ValueError(
            f"names has {len(names)} entries but {label} has {len(paths_leaves)} leaves"
        )
    return list(names)


def device_tag() -> str:
    """The placement tag of the default backend, spelled as torch spells its devices so a
    plan made from a JAX model on a GPU matches one made from the torch model: ``"cuda"``
    for JAX's ``gpu``/``cuda``/``rocm`` (torch calls a ROCm device ``cuda`` too), the
    backend's own name otherwise (``"cpu"``, ``"tpu"``: torch has no TPU tag to match).
    The one tag every JAX spec builder uses (``param_specs``, ``torch_specs``)."""
    backend = jax.default_backend()
    return {"gpu": "cuda", "cuda": "cuda", "rocm": "cuda"}.get(backend, backend)


def param_specs(tree: Any) -> list[ParamSpec]:
    """One ParamSpec per leaf of ``tree``, in ``jax.tree_util`` flattening order.

    Works on arrays and on ``jax.ShapeDtypeStruct`` leaves (``jax.eval_shape`` output).

    Example:
        >>> [s.name for s in param_specs({"params": {"Dense_0": {"kernel": np.zeros((2, 3))}}})]
        ['params/Dense_0/kernel']
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [
        ParamSpec(
            name=path_name(path),
            shape=tuple(int(d) for d in leaf.shape),
            dtype=np.dtype(leaf.dtype).name,
            device=device_tag(),
        )
        for path, leaf in leaves
    ]
