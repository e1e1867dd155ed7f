"""Where each leaf of a Flax parameter tree lives in a parameter-shard plan (docs/jax-zero3.md).

The plan (``gradsync_core.plan_param_shards``, docs/design.md §16) is made under torch's names
and layouts, so the same model written in torch and in Flax gets the same fingerprint, and
each device holds exactly the elements torch's ``fully_shard`` rank of the same index holds.
A Flax ``Dense`` kernel ``(in, out)`` is torch's ``Linear.weight`` transposed, so the chunks
are cut from the kernel in torch's layout (rows of ``out``): ``LeafLayout.perm`` is the
transposition, found by asking ``to_torch_state`` (the one home of the layout rules, §13).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np

from gradsync_core import ParamShardPlan, chunk_rows, plan_param_shards
from gradsync_core.deprecation import deprecated_keywords, warn_deprecated
from gradsync_jax._naming import flax_name, to_torch_state, torch_name, torch_names, torch_specs

# Distinct dim sizes of a probe array: the shape of its torch-layout copy names the transposition.
_PROBE_DIMS = (2, 3, 5, 7, 11, 13, 17, 19)


@dataclass(frozen=True, slots=True, kw_only=True)
class LeafLayout:
    """One parameter leaf: its Flax spelling and the plan entry (torch spelling) it executes.

    The device stores ``(padded_rows, *torch_shape[1:])``: its rows of dim 0 of the parameter
    in torch's layout, zero padded to ``padded_rows`` (FSDP2's cut, ``chunk_rows``).
    """

    name: str  # the plan's (torch) name
    flax_name: str  # slash path without linen's ``params`` or nnx's ``.value``
    shape: tuple[int, ...]  # Flax shape
    torch_shape: tuple[int, ...]
    perm: tuple[int, ...]  # torch_array = flax_array.transpose(perm)
    dtype: str
    unit: int
    trainable: bool
    padded_rows: int

    @property
    def rows(self) -> int:
        return self.torch_shape[0]

    @property
    def inverse_perm(self) -> tuple[int, ...]:
        return tuple(int(i) for i in np.argsort(self.perm))

    @property
    def local_shape(self) -> tuple[int, ...]:
        """What one device stores, padding included."""
        return (self.padded_rows, *self.torch_shape[1:])


@dataclass(frozen=True, slots=True, kw_only=True)
class ParamLayout:
    """A ``ParamShardPlan`` (torch names) bound to the leaves of one Flax parameter tree.

    ``leaves`` follow ``jax.tree_util`` flattening order of the tree; ``treedef`` is its
    structure. Build it with ``param_layout``.
    """

    plan: ParamShardPlan
    leaves: tuple[LeafLayout, ...]
    treedef: Any
    # The Flax -> torch module renames the names were made with: a checkpoint names the
    # parameters, their state and weights the same way (gradsync_jax.checkpoint.param_shards).
    modules: Mapping[str, str] | None = None

    @property
    def world_size(self) -> int:
        """The devices each parameter is cut over (the shard axis; all of them without HSDP)."""
        return self.plan.shard_size


def _perms(params: Any, modules: Mapping[str, str] | None) -> list[tuple[int, ...]]:
    """Each leaf's transposition into torch's layout, read off ``to_torch_state``."""
    leaves = jax.tree.leaves(params)
    too_deep = [np.ndim(x) for x in leaves if np.ndim(x) > len(_PROBE_DIMS)]
    if too_deep:
        raise ValueError(f"a parameter has {too_deep[0]} dims; at most {len(_PROBE_DIMS)} work")
    probe = jax.tree.map(lambda x: np.zeros(_PROBE_DIMS[: np.ndim(x)], np.int8), params)
    torch_state = to_torch_state(probe, modules=modules)
    names = torch_names(params, modules=modules)
    return [tuple(_PROBE_DIMS.index(d) for d in torch_state[n].shape) for n in names]


def _matches(name: str, prefix: str, sep: str = "/") -> bool:
    return name == prefix or name.startswith(prefix + sep)


def _torch_path(
    path: str, flax_names: Sequence[str], names: Sequence[str], modules: Any, what: str
) -> tuple[str, bool]:
    """The torch path a unit or frozen path names, and whether it was spelled the Flax way.

    Either spelling works: Flax's (``transformer/h_0``, ``Dense_0/kernel``; renamed by
    ``modules``) or torch's dotted one (``transformer.h.0``, ``fc1.weight``), the one
    ``fully_shard``, the checkpoint and the ``gradsync`` CLI use. A path that reads as both but
    names different torch modules is refused.
    """
    path = path.strip("/")
    as_flax = None
    if any(_matches(n, path) for n in flax_names):
        # the torch module path of a Flax module path (``layers/0`` -> ``layers.0``)
        as_flax = torch_name(path + "/_", modules=modules).removesuffix("._").removesuffix("_")
    as_torch = path if any(_matches(n, path, ".") for n in names) else None
    if as_flax is not None and as_torch is not None and as_flax != as_torch:
        raise ValueError(
            f"{what} {path!r} is both the Flax path of torch module {as_flax!r} and the torch "
            f"path {as_torch!r}; spell it the other way to say which (Flax: '/', torch: '.')"
        )
    if as_flax is None and as_torch is None:
        top = sorted({n.split("/")[0] for n in flax_names})[:5]
        raise ValueError(
            f"{what} {path!r} matches no parameter; give a Flax module path such as 'layers/0' "
            f"or a parameter path such as 'Dense_0/kernel', or the torch spelling "
            f"('layers.0', 'fc1.weight') (top level: {top})"
        )
    return (as_flax, True) if as_flax is not None else (path, False)


@deprecated_keywords(replicate_size="dp_shard=world_size // replicate_size")
def param_layout(
    params: Any,
    *,
    world_size: int,
    units: Iterable[str] = (),
    frozen: Iterable[str] = (),
    modules: Mapping[str, str] | None = None,
    order: Sequence[str] | None = None,
    dp_shard: int | None = None,
    replicate_size: int | None = None,
) -> ParamLayout:
    """Plan FSDP2's dim-0 cut of a Flax parameter tree over ``world_size`` devices.

    Args:
        params: linen ``variables``/``params`` or ``nnx.state(model, nnx.Param)``; arrays or
            ``jax.ShapeDtypeStruct`` leaves.
        world_size: data-parallel devices (``Topology.dp``; under HSDP the shard axis's
            size times the replicas).
        units: module paths gathered together, one per block, spelled the Flax way
            (``"layers/0"``, ``"Dense_3"``) or torch's (``"transformer.h.0"``, as
            ``fully_shard`` and the ``gradsync`` CLI take them); the root unit holds every
            other parameter (FSDP2's ``fully_shard`` per block and on the root).
        frozen: parameter or module paths that do not train (torch's
            ``requires_grad=False``), in either spelling: sharded and gathered, never
            reduced or updated.
        modules: Flax -> torch module renames (``gradsync_jax.torch_specs``).
        order: torch names in registration order (``gradsync_jax.torch_specs``); the
            fingerprint equals torch's only when the twin registers its parameters in this
            order (by default the natural order: modules by index, ``weight`` before
            ``bias``; pass ``[n for n, _ in torch_model.named_parameters()]`` otherwise).
        dp_shard: hybrid sharding (HSDP, ``Topology.dp_shard``): cut over ``dp_shard``
            devices and replicate across ``world_size // dp_shard`` groups, as FSDP2's 2-D
            mesh; ``zero3_step`` on ``mesh_from_topology(topology)`` finds the axes. Default
            ``world_size`` (no HSDP).
        replicate_size: the deprecated spelling: ``world_size // dp_shard``.

    Returns:
        A ``ParamLayout`` whose ``plan.fingerprint`` equals the torch plan of the twin model.

    Raises:
        ValueError: a unit or frozen path that names no parameter (or reads as two different
            modules in the two spellings), or what
            ``plan_param_shards`` refuses (a 0-d parameter, a repeated unit).

    Example:
        >>> layout = param_layout(params, world_size=8, units=["Dense_0", "Dense_1"])
        >>> layout = param_layout(params, world_size=8, units=["h.0", "h.1"])  # torch's
    """
    paths_leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    fnames = [flax_name(path) for path, _ in paths_leaves]
    names = torch_names(params, modules=modules)
    frozen = [f.strip("/") for f in ([frozen] if isinstance(frozen, str) else frozen)]
    # A Flax path matches the Flax names (a module renamed in part still matches), a torch
    # path the torch names.
    flax_frozen = [f for f in frozen if _torch_path(f, fnames, names, modules, "frozen path")[1]]
    torch_frozen = [f for f in frozen if f not in flax_frozen]
    is_frozen = {
        n: any(_matches(f, p) for p in flax_frozen)
        or any(_matches(n, p, ".") for p in torch_frozen)
        for n, f in zip(names, fnames, strict=True)
    }
    specs = [
        dataclasses.replace(s, requires_grad=not is_frozen[s.name])
        for s in torch_specs(params, modules=modules, order=order)
    ]
    if isinstance(units, str):
        raise TypeError(f"units must be a sequence of module paths, not the string {units!r}")
    torch_units = [_torch_path(u, fnames, names, modules, "unit")[0] for u in units]
    if replicate_size is not None:  # the deprecated spelling counts the replicas
        if dp_shard is not None:
            raise TypeError(
                "param_layout() got dp_shard= and its deprecated spelling replicate_size=; "
                "pass dp_shard="
            )
        warn_deprecated(
            "param_layout(replicate_size=)", "param_layout(dp_shard=world_size // replicate_size)"
        )
        if not isinstance(replicate_size, int) or replicate_size < 1 or world_size % replicate_size:
            raise ValueError(
                f"replicate_size {replicate_size!r} does not divide world_size {world_size}; "
                "HSDP needs world_size = shard_size * replicate_size"
            )
        dp_shard = world_size // replicate_size
    plan = plan_param_shards(specs, world_size=world_size, units=torch_units, dp_shard=dp_shard)
    perms = _perms(params, modules)
    leaves = []
    for fname, name, perm, (_, leaf) in zip(fnames, names, perms, paths_leaves, strict=True):
        entry = plan.param(name)
        leaves.append(
            LeafLayout(
                name=name,
                flax_name=fname,
                shape=tuple(int(d) for d in np.shape(leaf)),
                torch_shape=entry.shape,
                perm=perm,
                dtype=entry.dtype,
                unit=entry.unit,
                trainable=entry.requires_grad,
                padded_rows=chunk_rows(entry.shape[0], plan.shard_size, 0)[2],
            )
        )
    return ParamLayout(
        plan=plan,
        leaves=tuple(leaves),
        treedef=treedef,
        modules=None if modules is None else dict(modules),
    )
