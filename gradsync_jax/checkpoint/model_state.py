"""Model weights in a gradsync checkpoint, the JAX side (docs/checkpoints.md).

``save_optimizer_state(..., model=params)`` stores a Flax parameter tree beside the optimizer
state in torch's names and layouts (``to_torch_state``), whole, each in the file of the rank
that owns the parameter's state (``gradsync_core.model_owners``), as ``"__model__/<name>"``.
``load_params`` reads weights written by either framework back into a tree shaped like a
given one (linen ``variables`` or ``nnx.state(model, nnx.Param)``; for NNX, apply it with
``nnx.update(model, params)``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gradsync_core import ShardPlan, read_manifest
from gradsync_core.checkpoint import (
    check_weight_names,
    model_key,
    model_owners,
    reading_version,
    resolve_checkpoint,
)
from gradsync_core.deprecation import renamed_keywords
from gradsync_jax._naming import (
    flax_name,
    from_torch_layout,
    torch_layout_views,
    torch_names,
)
from gradsync_jax.checkpoint.stored import StoredFiles, check_finite


def host_copy(array: Any) -> np.ndarray:
    """A replicated array as one NumPy copy, also when other processes hold other devices."""
    if isinstance(array, jax.Array) and not array.is_fully_addressable:
        if not array.is_fully_replicated:
            raise ValueError(
                f"a model weight of shape {array.shape} is sharded over processes; "
                "store weights replicated over the data-parallel devices, as "
                "data_parallel_step keeps them"
            )
        return np.asarray(array.addressable_data(0))
    return np.asarray(array)


def weights_by_rank(
    model: Any, plan: ShardPlan, *, modules: Mapping[str, str] | None = None
) -> tuple[dict[int, dict[str, np.ndarray]], dict[str, int]]:
    """``model``'s weights in torch names and layouts, grouped by the rank file that holds
    each, and the owners map the manifest records as ``extra["model"]``."""
    host = jax.tree_util.tree_map(host_copy, model)
    weights = torch_layout_views(host, modules=modules)  # the write (or staging) copies them
    owners = model_owners(plan, list(weights))
    files: dict[int, dict[str, np.ndarray]] = {}
    for name, weight in weights.items():
        files.setdefault(owners[name], {})[model_key(name)] = weight
    return files, owners


@renamed_keywords(directory="path", cast="allow_dtype_conversion")
def load_params(
    path: str | os.PathLike[str],
    like: Any,
    *,
    modules: Mapping[str, str] | None = None,
    allow_dtype_conversion: bool = False,
    allow_nonfinite: bool = False,
) -> Any:
    """The model weights of a gradsync checkpoint (written by torch or JAX) as a tree like
    ``like``: Flax layouts (Dense kernels back to ``(in, out)``), NumPy arrays.

    Strict like ``load_state_dict``: every parameter of ``like`` must be stored with the
    same shape and dtype and nothing else may be; everything is checked before the tree is
    built.

    Args:
        path: a checkpoint saved with model weights (``ZeroRedundancyOptimizer.save(path,
            model=net)`` or ``save_optimizer_state(..., model=params)``).
        like: linen ``variables``/``params`` or ``nnx.state(model, nnx.Param)`` (with frozen
            weights kept in another ``Variable`` type ``Frozen``: ``nnx.state(model,
            nnx.Any(nnx.Param, Frozen))``); arrays or ``jax.ShapeDtypeStruct`` leaves.
        modules: Flax-to-torch module renames (see ``torch_name``), as given at save time.
        allow_dtype_conversion: convert weights stored in another floating dtype (a
            ``bfloat16`` checkpoint into ``float32`` parameters, or back) instead of refusing
            them.
        allow_nonfinite: take weights holding NaN or inf as they are (say, to look at a
            diverged run); by default they are refused, as ``load_optimizer_state`` refuses
            them in state.

    Returns:
        A tree with ``like``'s structure (for NNX: ``nnx.update(model, tree)``).

    Raises:
        ValueError: one sentence naming the missing, unexpected, mismatched or non-finite
            weight, or the missing or corrupt file.

    Example:
        >>> params = load_params("ckpt", variables, modules={"Dense_0": "fc1"})  # doctest: +SKIP
    """
    directory = resolve_checkpoint(path)  # one version, even while a save switches it
    with reading_version(directory):  # a later save that removes it: a sentence, load again
        stored = _stored_weights(directory)
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = torch_names(like, modules=modules)
    check_weight_names(stored, names, fix=_names_fix(stored, names))
    if not allow_nonfinite:
        check_finite({model_key(name): value for name, value in stored.items()})
    out = [
        _weight(flax_name(where), name, stored[name], leaf, convert=allow_dtype_conversion)
        for (where, leaf), name in zip(paths_leaves, names, strict=True)
    ]
    return jax.tree_util.tree_unflatten(treedef, out)


def _stored_weights(directory: str) -> dict[str, np.ndarray]:
    """Every model weight of the checkpoint version ``directory``, by parameter name, every
    file's hash checked first (nothing else of the files is read)."""
    manifest = read_manifest(directory)  # hashes every file
    with StoredFiles(directory, manifest) as stored:
        return stored.read_weights()


def check_weights(
    stored: Mapping[str, Any], like: Any, *, modules: Mapping[str, str] | None = None
) -> list[str]:
    """Every check ``load_params`` makes of the weights (names, shapes and dtypes, no cast), on
    ``stored`` weights or their stand-ins (``StoredFiles.weights``): the checkpoint name of
    each leaf of ``like``.

    Raises:
        ValueError: as ``load_params``, but for non-finite values (they are not read here).
    """
    paths_leaves, _ = jax.tree_util.tree_flatten_with_path(like)
    names = torch_names(like, modules=modules)
    check_weight_names(stored, names, fix=_names_fix(stored, names))
    for (path, leaf), name in zip(paths_leaves, names, strict=True):
        _dtype(flax_name(path), name, stored[name], leaf, convert=False)
    return names


def _names_fix(stored: Mapping[str, Any], names: list[str]) -> str:
    """What to do when the names differ: a tree that only lacks stored weights is usually an
    NNX state filtered to ``nnx.Param`` while the model keeps frozen weights in another
    ``Variable`` type (torch stores a frozen parameter like any other)."""
    if set(names) < set(stored):
        return (
            "if the model keeps them outside nnx.Param (a frozen Variable type), load a state "
            "that holds them too: load_params(path, nnx.state(model, nnx.Any(nnx.Param, "
            "Frozen))) with Frozen that type, then nnx.update(model, params)"
        )
    return "pass the modules= renames used at save time, or load into the model that was saved"


def _weight(where: str, name: str, saved: np.ndarray, leaf: Any, *, convert: bool) -> np.ndarray:
    """The stored weight ``name`` in Flax layout for the leaf at ``where``, refused unless its
    shape and dtype are the leaf's (the dtype converted between floating types if
    ``convert``)."""
    value = from_torch_layout(where, saved)
    dtype = _dtype(where, name, saved, leaf, convert=convert)
    return value if value.dtype == dtype else value.astype(dtype)


def _dtype(where: str, name: str, saved: np.ndarray, leaf: Any, *, convert: bool) -> np.dtype:
    """The leaf's dtype, once the stored weight (or its stand-in) is checked to fit the leaf
    at ``where``: its shape in Flax layout, and its dtype or, with ``convert``, a floating
    one."""
    value = from_torch_layout(where, saved)
    shape, dtype = tuple(leaf.shape), np.dtype(leaf.dtype)
    stored = f"{saved.shape} {saved.dtype} in the checkpoint (torch layout)"
    if tuple(value.shape) != shape:
        raise ValueError(
            f"weight {name!r} is {stored}, which is not {shape} {dtype} in Flax layout for "
            f"{where!r}: another model?"
        )
    if value.dtype == dtype:
        return dtype
    if not (jnp.issubdtype(value.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)):
        raise ValueError(
            f"weight {name!r} is {value.dtype} in the checkpoint but {dtype} for {where!r}: a "
            "dtype mismatch that no cast makes exact"
        )
    if not convert:
        raise ValueError(
            f"weight {name!r} is {value.dtype} in the checkpoint but {dtype} for {where!r} "
            f"(same shape {shape}): only the dtype differs; pass allow_dtype_conversion=True "
            "to convert it"
        )
    return dtype
