"""``fully_shard``: FSDP2's entry point over a gradsync parameter-shard plan (docs/torch-zero3.md).

Each call plans the module it is given with ``gradsync_core.plan_param_shards`` (the blocks
already sharded inside it are the plan's inner units), checks that every rank planned the same
thing, and cuts the call's own parameters exactly where the plan's chunks say.
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from gradsync_core import ParamShardPlan, plan_param_shards
from gradsync_torch._specs import param_specs
from gradsync_torch.agreement import Disagreement, agree_ok, agree_on
from gradsync_torch.param_sharding._hooks import ShardUnit, Step
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy
from gradsync_torch.param_sharding._unit import UnitParameters, shard_parameter

_UNIT = "_gradsync_shard_unit"  # the attribute a sharded module keeps its ShardUnit in


class ShardedModule:
    """Mixed into a module's class by ``fully_shard``, like FSDP2's ``FSDPModule``."""

    def _units(self, recurse: bool) -> list[ShardUnit]:
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        return [unit for m in modules if (unit := getattr(m, _UNIT, None)) is not None]

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True):
        """Turn the reduce-scatter after backward off (micro-steps of gradient accumulation:
        gradients then accumulate unsharded) or back on, for this unit and, with ``recurse``,
        every unit inside it. FSDP2's method of the same name."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync

    def unshard(self) -> None:
        """Gather this module's unit now (it stays gathered until ``reshard``)."""
        getattr(self, _UNIT).params.gather()

    def reshard(self) -> None:
        """Free this module's gathered parameters, back to the shards."""
        getattr(self, _UNIT).params.free()

    @property
    def shard_plan(self) -> ParamShardPlan:
        """The plan this call was cut from (module paths relative to this module)."""
        return self._gradsync_shard_plan  # type: ignore[attr-defined]


def _mesh(mesh: DeviceMesh | None, process_group: Any, device_type: str) -> DeviceMesh:
    if mesh is not None and process_group is not None:
        raise ValueError("pass mesh or process_group to fully_shard, not both")
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "fully_shard needs torch.distributed: call "
            "torch.distributed.init_process_group('gloo' or 'nccl') first"
        )
    if mesh is None:
        if process_group is None:
            return init_device_mesh(device_type, (dist.get_world_size(),))
        return DeviceMesh.from_group(process_group, device_type)
    if not isinstance(mesh, DeviceMesh) or mesh.ndim not in (1, 2):
        raise ValueError(
            f"fully_shard takes a 1-D DeviceMesh (shard) or a 2-D one (replicate, shard) for "
            f"hybrid sharding (HSDP), as FSDP2; got {mesh!r}"
        )
    return mesh


class _Layout(NamedTuple):
    """Where one fully_shard call's collectives run: the shard group (all-gather,
    reduce-scatter) and, under HSDP, the replicate group (the gradients' all-reduce)."""

    group: dist.ProcessGroup
    shard_size: int
    shard_rank: int
    replicate_group: dist.ProcessGroup | None
    replicate_size: int
    placements: tuple[Placement, ...]


def _layout(mesh: DeviceMesh) -> _Layout:
    # FSDP2's HSDPMeshInfo: dim 1 shards, dim 0 replicates; parameters (Replicate(), Shard(0)).
    if mesh.ndim == 1:
        return _Layout(mesh.get_group(), mesh.size(), mesh.get_local_rank(), None, 1, (Shard(0),))
    replicate = mesh.size(0)
    return _Layout(
        mesh.get_group(1),
        mesh.size(1),
        mesh.get_local_rank(1),
        mesh.get_group(0) if replicate > 1 else None,
        replicate,
        (Replicate(), Shard(0)),
    )


def _agree_plan(plan: ParamShardPlan, layout: _Layout, where: str) -> None:
    """Every rank of the mesh planned the same, or the same sentence on every rank.

    Under HSDP the shard group agrees first; ``agree_ok`` then tells each replicate group
    whether a shard group failed (each replicate group meets every shard group, so every rank
    hears it) before the replicas compare their plans, so no rank walks on alone.
    """
    describe = _describe(where)
    if layout.replicate_group is None:
        agree_on(plan.to_json(), layout.group, describe=describe)
        return
    try:
        agree_on(plan.to_json(), layout.group, describe=describe)
        error = None
    except ValueError as exc:
        error = str(exc)
    agree_ok(error, layout.replicate_group, what=f"fully_shard({where})")
    agree_on(plan.to_json(), layout.replicate_group, describe=describe)


def _describe(where: str) -> Any:
    def describe(d: Disagreement) -> str:
        base, other = d.base["params"], d.other["params"]
        detail = f"rank {d.base_rank} has {len(base)} parameters, rank {d.other_rank} {len(other)}"
        for mine, theirs in zip(base, other, strict=False):  # lengths may differ
            if mine != theirs:
                unit = d.base["units"][mine["unit"]]["prefix"] or "<root>"
                diff = {k: (mine[k], theirs.get(k)) for k in mine if mine[k] != theirs.get(k)}
                detail = f"parameter {mine['name']!r} (unit {unit!r}) differs: " + ", ".join(
                    f"{k} {a!r} on rank {d.base_rank} vs {b!r} on rank {d.other_rank}"
                    for k, (a, b) in diff.items()
                )
                break
        else:
            if d.base.get("units") != d.other.get("units"):
                detail = "the units differ (different fully_shard calls)"
        return (
            f"fully_shard({where}): the parameter-shard plan differs across ranks "
            f"(ranks {d.agreeing} agree with rank {d.base_rank}, ranks {d.differing} do not): "
            f"{detail}; build the same model and call fully_shard on the same modules on "
            "every rank"
        )

    return describe


def _check_module(module: nn.Module) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard takes an nn.Module, got {type(module).__name__}")
    if getattr(module, _UNIT, None) is not None:
        raise ValueError(f"fully_shard was already applied to this {type(module).__name__}")


def _places(
    module: nn.Module, names: tuple[str, ...], inner: dict[str, ShardUnit]
) -> dict[str, tuple[tuple[nn.Module, str], ...]]:
    """Every (module, attribute) holding each parameter in ``names``: one, or more if tied.

    Raises:
        NotImplementedError: a tied weight whose users are in different units.
    """
    by_id: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(param), []).append(name)
    out = {}
    for name in names:
        param = module.get_parameter(name)
        for prefix, unit in inner.items():
            ref = unit.originals.get(id(param))
            if ref is not None and ref() is param:
                raise NotImplementedError(
                    f"parameter {name!r} is tied to a parameter that fully_shard({prefix!r}) "
                    "already sharded; wrap both users of a tied weight in one unit (shard the "
                    "common parent only)"
                )
        aliases = by_id[id(param)]
        for alias in aliases:
            unit_of = next((p for p in inner if alias.startswith(p + ".")), None)
            if unit_of is not None:
                raise NotImplementedError(
                    f"parameter {name!r} is tied to {alias!r} inside unit {unit_of!r}; wrap "
                    "both users of a tied weight in one unit"
                )
        out[name] = tuple(
            (module.get_submodule(a.rpartition(".")[0]), a.rpartition(".")[2]) for a in aliases
        )
    return out


def _sharded_class(cls: type) -> type:
    if issubclass(cls, ShardedModule):
        return cls
    cached = _CLASSES.get(cls)
    if cached is None:
        cached = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return cached


_CLASSES: dict[type, type] = {}
_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # frozen, so one shared default is safe


def fully_shard(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
) -> nn.Module:
    """Shard ``module``'s parameters over the data-parallel ranks (ZeRO-3), as FSDP2 does.

    Call it on each block, then on the root, exactly as ``torch.distributed.fsdp.fully_shard``:
    each call manages the parameters of ``module`` that no earlier call inside it manages.
    Afterwards those parameters are ``DTensor``s sharded on dim 0 (``Shard(0)``), cut where the
    ``gradsync_core`` plan says, so ``torch.optim.*(model.parameters())``,
    ``clip_grad_norm_`` and ``state_dict()`` work on them as on FSDP2's. The forward gathers a
    unit just before it runs (prefetching the next) and frees it after
    (``reshard_after_forward``; the root stays gathered for the backward); the backward gathers
    it again (prefetching the next), reduce-scatters its gradients (averaged with FSDP2's
    arithmetic) as soon as its backward is done, and frees it.

    Args:
        module: the block or the root model; its parameters on one device, not yet sharded.
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (default: the world), or a 2-D
            one ``(replicate, shard)`` for hybrid sharding (HSDP; ``hsdp_mesh`` builds it
            from a ``Topology``): shard over dim 1, all-reduce gradients over dim 0.
        process_group: the data-parallel group instead of ``mesh``.
        reshard_after_forward: free the gathered parameters after forward (``False`` keeps
            them to the backward, trading memory for one all-gather).
        mp_policy: gather in ``param_dtype``, reduce in ``reduce_dtype``.

    Returns:
        ``module`` itself, its class now also a ``ShardedModule``
        (``set_requires_gradient_sync``, ``unshard``, ``reshard``).

    Raises:
        ValueError: the plan differs across ranks (the same sentence on every rank), the module
            is already sharded, options conflict, or the mesh is not 1-D or 2-D. At run time,
            ranks that run the model differently (``_agreement.py``).
        NotImplementedError: a weight tied across units.

    Example:
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)  # doctest: +SKIP
    """
    _check_module(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    first = next(module.parameters(), None)
    mesh = _mesh(mesh, process_group, first.device.type if first is not None else "cpu")
    layout = _layout(mesh)
    world_size = layout.shard_size
    inner = {p: u for p, m in module.named_modules() if p and (u := getattr(m, _UNIT, None))}
    plan = plan_param_shards(
        param_specs(module),
        world_size=world_size * layout.replicate_size,
        units=list(inner),
        replicate_size=layout.replicate_size,
    )
    _agree_plan(plan, layout, type(module).__name__)
    params = []
    places = _places(module, plan.units[0].params, inner)
    originals = [module.get_parameter(name) for name in plan.units[0].params]
    for name in plan.units[0].params:  # the root unit: what no inner call manages
        chunks = tuple(plan.chunk(name, r) for r in range(world_size))
        params.append(
            shard_parameter(
                name,
                places[name],
                chunks,
                layout.shard_rank,
                mesh,
                mp_policy.param_dtype,
                layout.placements,
            )
        )
    unit_params = UnitParameters(
        params,
        group=layout.group,
        world_size=world_size,
        policy=mp_policy,
        replicate_group=layout.replicate_group,
    )
    unit = ShardUnit(
        module, "", unit_params, reshard_after_forward=reshard_after_forward, policy=mp_policy
    )
    step = Step([unit])
    for u in plan.units[1:]:
        child = inner[u.prefix]
        child.prefix, child.is_root, child.step = u.prefix, False, step
        step.units.append(child)
    unit.step = step
    step.agreement.scheduled = step.can_schedule()
    unit.originals = {id(p): weakref.ref(p) for p in originals}
    module.__class__ = _sharded_class(type(module))
    object.__setattr__(module, _UNIT, unit)
    object.__setattr__(module, "_gradsync_shard_plan", plan)
    return module
