"""The one place where torch and Flax parameter names and layouts meet.

gradsync's canonical parameter list is torch's: names, shapes and order of
``module.named_parameters()``. A Flax parameter tree maps onto it by these rules, so a
bucket plan built from ``torch_specs(flax_params)`` has the same fingerprint as one built
from ``gradsync_torch.param_specs(torch_module)`` for the same model.

Names (``torch_name``):
  1. Drop a leading ``params`` collection (linen's ``{"params": ...}`` variables) and a
     trailing nnx ``Variable`` attribute (``.value``).
  2. Join the remaining keys with ``.`` (``layers/0/kernel`` -> ``layers.0.kernel``), after
     renaming module paths by ``modules`` (longest matching prefix wins), e.g.
     ``{"Dense_0": "fc1"}``.
  3. Rename the leaf: ``kernel``/``scale``/``embedding`` -> ``weight``; others unchanged.

Layouts (``to_torch_layout`` / ``from_torch_layout``): a 2-D ``kernel`` (Flax Dense,
``(in, out)``) is the transpose of torch ``Linear.weight`` ``(out, in)``; an N-D ``kernel``
(Flax Conv, ``(*spatial, in, out)``) is torch's ``(out, in, *spatial)``. Everything else
(biases, LayerNorm scales, embeddings ``(num, dim)``) has the same layout.

Order: torch registration order. A Flax tree is a sorted mapping (``Dense_10`` sorts before
``Dense_2``, ``bias`` before ``kernel``), so ``torch_specs`` reorders: module paths in
natural order (digit runs compared as numbers: ``Dense_2`` < ``Dense_10``, ``layers.2`` <
``layers.10``), then inside a module ``weight`` before ``bias`` (the order Linear, Conv and
LayerNorm register them). That is the registration order of models built in index order
(``nn.Sequential``, ``ModuleList``, numbered layers); for any other model pass ``order=``,
the torch names in registration order.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from gradsync_core import ParamSpec, ShardPlan
from gradsync_jax._specs import device_tag, path_name

_LEAF_TO_TORCH = {"kernel": "weight", "scale": "weight", "embedding": "weight"}
_LEAF_ORDER = {"weight": 0, "bias": 1}  # torch's registration order inside a module


def _keys(path: tuple[Any, ...]) -> list[str]:
    keys = path_name(path).split("/")
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        keys = keys[:-1]  # nnx Variable -> its array
    if len(keys) > 1 and keys[0] == "params":
        keys = keys[1:]  # linen's variables collection
    return keys


def flax_name(path: tuple[Any, ...]) -> str:
    """The slash name of a tree leaf without linen's ``params`` collection or nnx's
    ``.value`` (``layers/0/kernel``): what ``torch_name`` and the layout rules read."""
    return "/".join(_keys(path))


def torch_name(flax_name: str, *, modules: Mapping[str, str] | None = None) -> str:
    """The torch name of a Flax parameter given by its slash name (``params/Dense_0/kernel``).

    Args:
        flax_name: ``path_name`` of the leaf, ``/``-separated.
        modules: renames of Flax module paths (``/`` or ``.`` separated) to torch module
            names, e.g. ``{"Dense_0": "fc1"}``; the longest matching prefix wins.

    Example:
        >>> torch_name("params/Dense_0/kernel", modules={"Dense_0": "fc1"})
        'fc1.weight'
    """
    keys = flax_name.split("/")
    if len(keys) > 1 and keys[0] == "params":
        keys = keys[1:]
    return _torch_name_of_keys(keys, modules)


def _torch_name_of_keys(keys: list[str], modules: Mapping[str, str] | None) -> str:
    *module, leaf = keys
    dotted = ".".join(module)
    for prefix in sorted(modules or {}, key=len, reverse=True):
        flat = prefix.replace("/", ".")
        if dotted == flat or dotted.startswith(flat + "."):
            dotted = (modules or {})[prefix] + dotted[len(flat) :]
            break
    leaf = _LEAF_TO_TORCH.get(leaf, leaf)
    return f"{dotted}.{leaf}" if dotted else leaf


def torch_names(tree: Any, *, modules: Mapping[str, str] | None = None) -> list[str]:
    """The torch name of every leaf of ``tree``, in ``jax.tree_util`` flattening order.

    Pass it as ``sync_gradients(grads, names=torch_names(grads), plan=plan)`` to sync with
    a plan built from the torch module.
    """
    paths = [path for path, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]
    return [_torch_name_of_keys(_keys(path), modules) for path in paths]


def _is_kernel(name: str) -> bool:
    return re.split(r"[/.]", name)[-1] == "kernel"


def to_torch_layout(name: str, array: Any) -> np.ndarray:
    """A Flax array (named by its slash name) in torch's layout; see the module docstring."""
    array = np.asarray(array)
    if not _is_kernel(name) or array.ndim < 2:
        return array
    if array.ndim == 2:
        return array.T
    return np.transpose(array, (array.ndim - 1, array.ndim - 2, *range(array.ndim - 2)))


def from_torch_layout(name: str, array: Any) -> np.ndarray:
    """A torch array in the Flax layout of the parameter ``name``; inverse of
    ``to_torch_layout``."""
    array = np.asarray(array)
    if not _is_kernel(name) or array.ndim < 2:
        return array
    if array.ndim == 2:
        return array.T
    return np.transpose(array, (*range(2, array.ndim), 1, 0))


def _torch_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    if not _is_kernel(name) or len(shape) < 2:
        return shape
    return (shape[-1], shape[-2], *shape[:-2])


def _natural_key(name: str) -> tuple[Any, ...]:
    *module, leaf = name.split(".")
    parts = re.split(r"(\d+)", ".".join(module))
    return (
        tuple((0, int(p)) if p.isdigit() else (1, p) for p in parts),
        _LEAF_ORDER.get(leaf, 2),
        leaf,
    )


def torch_specs(
    tree: Any,
    *,
    modules: Mapping[str, str] | None = None,
    order: Sequence[str] | None = None,
) -> list[ParamSpec]:
    """Canonical (torch) ParamSpecs of a Flax parameter tree: names, shapes, order.

    Args:
        tree: linen ``variables``/``params`` or ``nnx.state(model, nnx.Param)``; arrays or
            ``jax.ShapeDtypeStruct`` leaves.
        modules: module renames, see ``torch_name``.
        order: torch names in registration order; default: natural order (module docstring).

    Returns:
        Specs equal to ``gradsync_torch.param_specs(module)`` for the matching torch model.

    Raises:
        ValueError: if two leaves map to one torch name, or ``order`` does not list exactly
            the tree's torch names.

    Example:
        >>> specs = torch_specs({"params": {"Dense_0": {"kernel": np.zeros((3, 2)),
        ...                                             "bias": np.zeros(2)}}})
        >>> [(s.name, s.shape) for s in specs]
        [('Dense_0.weight', (2, 3)), ('Dense_0.bias', (2,))]
    """
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    specs: dict[str, ParamSpec] = {}
    for path, leaf in leaves:
        keys = _keys(path)
        flax = "/".join(keys)
        name = _torch_name_of_keys(keys, modules)
        if name in specs:
            raise ValueError(
                f"two Flax parameters map to torch name {name!r} (one is {flax!r}); "
                "pass modules= renames that keep torch names distinct"
            )
        specs[name] = ParamSpec(
            name=name,
            shape=_torch_shape(flax, tuple(int(d) for d in leaf.shape)),
            dtype=np.dtype(leaf.dtype).name,
            device=device_tag(),
        )
    if order is None:
        return [specs[name] for name in sorted(specs, key=_natural_key)]
    check_order(order, specs)
    return [specs[name] for name in order]


def check_order(order: Sequence[str], names: Collection[str]) -> None:
    """Refuse an ``order=`` that does not list each torch name of the tree exactly once."""
    if sorted(order) != sorted(names):
        extra, missing = sorted(set(order) - set(names)), sorted(set(names) - set(order))
        raise ValueError(
            f"order must list every torch name once; unknown: {extra[:3]}, missing: {missing[:3]}"
        )


def to_torch_state(tree: Any, *, modules: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """A Flax parameter tree as a torch ``state_dict`` of NumPy arrays (torch names/layouts).

    The arrays are writable C-contiguous copies: load them with
    ``module.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()})``.
    """
    views = torch_layout_views(tree, modules=modules)
    return {name: np.array(array, copy=True, order="C") for name, array in views.items()}


def torch_layout_views(
    tree: Any, *, modules: Mapping[str, str] | None = None
) -> dict[str, np.ndarray]:
    """``to_torch_state`` without the copies: each leaf (host arrays) seen in torch's layout,
    a transposed view of it for a kernel; what a save writes from (or stages) as it lies."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        keys = _keys(path)
        out[_torch_name_of_keys(keys, modules)] = to_torch_layout("/".join(keys), leaf)
    return out


def from_torch_state(
    state: Mapping[str, Any], like: Any, *, modules: Mapping[str, str] | None = None
) -> Any:
    """A tree shaped like ``like`` holding ``state``'s arrays (torch ``state_dict``, NumPy or
    torch tensors via ``.numpy()``) in Flax layout and ``like``'s dtypes.

    Raises:
        KeyError: if ``state`` lacks a parameter of ``like``.
        ValueError: if a shape does not match after the layout change.
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(like)
    out = []
    for path, leaf in paths_leaves:
        keys = _keys(path)
        name = _torch_name_of_keys(keys, modules)
        if name not in state:
            raise KeyError(f"state has no parameter {name!r} (Flax {path_name(path)!r})")
        value = state[name]
        value = value.detach().cpu().numpy() if hasattr(value, "detach") else value
        array = from_torch_layout("/".join(keys), value)
        if tuple(array.shape) != tuple(leaf.shape):
            raise ValueError(
                f"{name!r} has torch shape {tuple(np.shape(value))}, which maps to "
                f"{array.shape} but the Flax parameter is {tuple(leaf.shape)}"
            )
        out.append(np.asarray(array, dtype=leaf.dtype))
    return jax.tree_util.tree_unflatten(treedef, out)


def registration_order(
    specs: Sequence[ParamSpec],
    *,
    order: Sequence[str] | None = None,
    modules: Mapping[str, str] | None = None,
) -> list[ParamSpec]:
    """Flax-named ``specs`` in the order torch registers the matching module's parameters.

    Torch's ZeRO greedy planner breaks ties between equal-sized parameters by registration
    order; planning Flax specs in this order gives every parameter the same owner as
    ``gradsync_torch.ZeroRedundancyOptimizer`` gives its twin (docs/checkpoints.md).

    Args:
        specs: specs named by Flax paths (``params/Dense_10/kernel``).
        order: torch names in registration order; default: natural order (module docstring).
        modules: the module renames that give ``order``'s names (see ``torch_name``).

    Raises:
        ValueError: if ``order`` does not list each parameter's torch name once.
    """
    names = [torch_name(spec.name, modules=modules) for spec in specs]
    if order is None:
        keys: list[Any] = [_natural_key(name) for name in names]
    else:
        check_order(order, names)
        position = {name: i for i, name in enumerate(order)}
        keys = [(position[name], name) for name in names]
    return [spec for _, spec in sorted(zip(keys, specs, strict=True), key=lambda kv: kv[0])]


def torch_plan(plan: ShardPlan, *, modules: Mapping[str, str] | None = None) -> ShardPlan:
    """``plan`` (named by Flax paths) with torch names, and a flat plan's bucket slots with
    torch names and shapes too: the plan torch would make (``ShardPlan.renamed``).

    Its fingerprint equals the one of ``ZeroRedundancyOptimizer.plan()`` for the twin torch
    module, greedy (ZeRO-1) or flat (``shard_gradients=True``, same ``bucket_cap_mb``). The
    element ranges of a flat plan are ranges of the torch layout: checkpoints cut the torch
    layout of each state tensor by them.
    """
    flax = {shard.name for shard in plan.shards}
    if plan.buckets is not None:
        flax.update(slot.name for slot in plan.buckets.slots)
    names = {name: torch_name(name, modules=modules) for name in flax}
    shapes = (
        {}
        if plan.buckets is None
        else {slot.name: _torch_shape(slot.name, slot.shape) for slot in plan.buckets.slots}
    )
    return plan.renamed(names, shapes=shapes)


def read_model(model: object) -> tuple[list[ParamSpec], tuple[str, ...]] | None:
    """Torch-named specs of a Flax model, for the command line's ``gradsync plan --model``
    (its ``gradsync.model_readers`` entry point): an NNX module's ``Param`` state, linen's
    ``params`` collection (not ``batch_stats`` and the like), or a parameter tree as given;
    ``None`` for anything else. A Flax tree holds a tied weight once, so none is listed.

    Raises:
        ValueError: a tree with a leaf that is not an array.
    """
    nnx = sys.modules.get("flax.nnx")  # an NNX module exists only where flax.nnx is imported
    if nnx is not None and isinstance(model, nnx.Module):
        tree: Any = nnx.state(model, nnx.Param)
    elif isinstance(model, Mapping):
        tree = {"params": model["params"]} if "params" in model else model
    else:
        return None
    try:
        return torch_specs(tree), ()
    except (AttributeError, TypeError) as err:  # a leaf without a shape or dtype
        raise ValueError(f"a tree with a leaf that is not an array ({err})") from None
