"""ParamSpecs from a JAX pytree: the only place JAX facts enter the planner."""

from __future__ import annotations

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
            device="cpu" if jax.default_backend() == "cpu" else "cuda",
        )
        for path, leaf in leaves
    ]
