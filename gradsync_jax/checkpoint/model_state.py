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
import numpy as np

from gradsync_core import ShardPlan, read_manifest
from gradsync_core.checkpoint import (
    check_weight_names,
    model_key,
    model_owners,
    rank_file,
    resolve_checkpoint,
    weight_owners,
)
from gradsync_jax._naming import flax_name, from_torch_layout, to_torch_state, torch_names
from gradsync_jax.checkpoint.safetensors_io import read_safetensors


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
    weights = to_torch_state(host, modules=modules)
    owners = model_owners(plan, list(weights))
    files: dict[int, dict[str, np.ndarray]] = {}
    for name, weight in weights.items():
        files.setdefault(owners[name], {})[model_key(name)] = weight
    return files, owners


def load_params(
    directory: str | os.PathLike[str], like: Any, *, modules: Mapping[str, str] | None = None
) -> Any:
    """The model weights of a gradsync checkpoint (written by torch or JAX) as a tree like
    ``like``: Flax layouts (Dense kernels back to ``(in, out)``), NumPy arrays.

    Strict like ``load_state_dict``: every parameter of ``like`` must be stored with the
    same shape and dtype and nothing else may be; everything is checked before the tree is
    built.

    Args:
        directory: a checkpoint saved with model weights (``ZeroRedundancyOptimizer.save(path,
            model=net)`` or ``save_optimizer_state(..., model=params)``).
        like: linen ``variables``/``params`` or ``nnx.state(model, nnx.Param)``; arrays or
            ``jax.ShapeDtypeStruct`` leaves.
        modules: Flax-to-torch module renames (see ``torch_name``), as given at save time.

    Returns:
        A tree with ``like``'s structure (for NNX: ``nnx.update(model, tree)``).

    Raises:
        ValueError: one sentence naming the missing, unexpected or mismatched weight, or the
            missing or corrupt file.

    Example:
        >>> params = load_params("ckpt", variables, modules={"Dense_0": "fc1"})  # doctest: +SKIP
    """
    directory = resolve_checkpoint(directory)  # one version, even while a save switches it
    manifest = read_manifest(directory)  # hashes every file
    owners = weight_owners(directory, manifest)
    stored: dict[str, np.ndarray] = {}
    for rank in sorted(set(owners.values())):
        name = rank_file(rank, manifest.world_size)
        try:
            tensors = read_safetensors(os.path.join(directory, name))
        except Exception as err:  # a malformed header or a dtype this reader does not know
            raise ValueError(f"checkpoint file {name} cannot be read ({err})") from None
        for param in (p for p, r in owners.items() if r == rank):
            if model_key(param) not in tensors:
                raise ValueError(f"checkpoint file {name} lacks the weight of {param!r}")
            stored[param] = tensors[model_key(param)]
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    names = torch_names(like, modules=modules)
    check_weight_names(
        stored,
        names,
        fix="pass the modules= renames used at save time, or load into the model that was saved",
    )
    out = []
    for (path, leaf), name in zip(paths_leaves, names, strict=True):
        value = from_torch_layout(flax_name(path), stored[name])
        want = (tuple(leaf.shape), np.dtype(leaf.dtype))
        if (tuple(value.shape), value.dtype) != want:
            raise ValueError(
                f"weight {name!r} is {stored[name].shape} {stored[name].dtype} in the "
                f"checkpoint (torch layout), which is not {want[0]} {want[1]} in Flax layout "
                f"for {flax_name(path)!r}: another model?"
            )
        out.append(value)
    return jax.tree_util.tree_unflatten(treedef, out)
