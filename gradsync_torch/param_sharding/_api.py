"""``fully_shard``: FSDP2's entry point over a gradsync parameter-shard plan (docs/torch-zero3.md).

Each call plans the module it is given with ``gradsync_core.plan_param_shards`` (the blocks
already sharded inside it are the plan's inner units), checks that every rank planned the same
thing, and cuts the call's own parameters exactly where the plan's chunks say.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from gradsync_core import ParamShardPlan, plan_param_shards
from gradsync_torch._specs import param_specs
from gradsync_torch.agreement import Disagreement, agree_ok, agree_on
from gradsync_torch.param_sharding._hooks import ShardUnit, Step
from gradsync_torch.param_sharding._module import PLAN, UNIT, sharded_class, unit_of
from gradsync_torch.param_sharding._optimizers import refuse_non_elementwise
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy
from gradsync_torch.param_sharding._stall import naming_stalls
from gradsync_torch.param_sharding._unit import ROWS, UnitParameters, shard_parameter


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
    label = f"the plan agreement of fully_shard({where})"
    if layout.replicate_group is None:
        with naming_stalls(label, layout.group):
            agree_on(plan.to_json(), layout.group, describe=describe)
        return
    try:
        with naming_stalls(label, layout.group):
            agree_on(plan.to_json(), layout.group, describe=describe)
        error = None
    except ValueError as exc:
        error = str(exc)
    with naming_stalls(label, layout.replicate_group):
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


def _modules(module: nn.Module | Sequence[nn.Module]) -> tuple[nn.Module, ...]:
    """The modules one call shards as one unit: ``module``, or a list's modules (FSDP2's
    list form) without those inside another of them, in the list's order."""
    listed = tuple(module) if isinstance(module, (list, tuple)) else (module,)
    if not listed:
        raise ValueError("fully_shard takes a module or a list of at least one module, got []")
    for m in listed:
        if not isinstance(m, nn.Module):
            raise TypeError(
                f"fully_shard takes an nn.Module or a list of them, got {type(m).__name__}"
            )
        if unit_of(m) is not None:
            raise ValueError(f"fully_shard was already applied to this {type(m).__name__}")
    inside = {id(sub) for m in listed for sub in m.modules() if sub is not m}
    roots: dict[int, nn.Module] = {}
    for m in listed:
        if id(m) not in inside:
            roots.setdefault(id(m), m)
    return tuple(roots.values())


def _unit_prefixes(inner: dict[str, ShardUnit], names: list[str]) -> list[str]:
    """The plan's block prefixes: every inner unit's, less the modules of a list unit that
    list no parameter of their own (a head whose weight is the embedding's, listed under the
    embedding's name): the unit is planned under its other modules' prefixes."""

    def holds(prefix: str) -> bool:
        return any(name.startswith(prefix + ".") for name in names)

    return [
        prefix
        for prefix, unit in inner.items()
        if len(unit.modules) == 1
        or holds(prefix)
        or not any(holds(p) for p, u in inner.items() if u is unit)
    ]


def _check_unsharded(module: nn.Module, names: Sequence[str], where: str) -> None:
    """The parameters this call shards are plain tensors, or a sentence.

    Raises:
        ValueError: one is already a row shard of an earlier call on a module containing
            this one (the root sharded before its blocks), or another DTensor.
    """
    for name in names:
        param = module.get_parameter(name)
        if not isinstance(param, DTensor):
            continue
        rows = getattr(param, ROWS, None)
        if rows is not None:
            raise ValueError(
                f"fully_shard({where}): parameter {name!r} is already sharded by "
                f"{rows.owner}, an earlier call on a module that contains this one; call "
                "fully_shard bottom-up, each block first, then the root (as FSDP2 requires)"
            )
        raise ValueError(
            f"fully_shard({where}): parameter {name!r} is already a DTensor placed "
            f"{tuple(param.placements)} (sharded by torch's fully_shard or tensor parallelism); "
            "gradsync's fully_shard shards plain parameters: build the model without torch's "
            "sharding"
        )


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
                    "already sharded; wrap both users of a tied weight in one unit: both in one "
                    "fully_shard([embedding, head]) call (FSDP2's list form), or neither and "
                    "shard their common parent"
                )
        aliases = by_id[id(param)]
        for alias in aliases:
            unit_of = next((p for p in inner if alias.startswith(p + ".")), None)
            if unit_of is not None:
                raise NotImplementedError(
                    f"parameter {name!r} is tied to {alias!r} inside unit {unit_of!r}; wrap "
                    "both users of a tied weight in one unit (fully_shard([embedding, head]))"
                )
        out[name] = tuple(
            (module.get_submodule(a.rpartition(".")[0]), a.rpartition(".")[2]) for a in aliases
        )
    return out


_NO_MIXED_PRECISION = MixedPrecisionPolicy()  # frozen, so one shared default is safe


def fully_shard(
    module: nn.Module | Sequence[nn.Module],
    *,
    mesh: DeviceMesh | None = None,
    process_group: dist.ProcessGroup | None = None,
    reshard_after_forward: bool = True,
    mp_policy: MixedPrecisionPolicy = _NO_MIXED_PRECISION,
) -> nn.Module:
    """Shard ``module``'s parameters over the data-parallel ranks (ZeRO-3), as FSDP2 does.

    Call it on each block, then on the root, exactly as ``torch.distributed.fsdp.fully_shard``:
    each call manages the parameters of ``module`` that no earlier call inside it manages. A
    list (``fully_shard([model.norm, model.output])``, FSDP2's list form) makes one unit of
    several modules: one all-gather and one reduce-scatter for all of them, as for a weight
    tied between the embedding and the head.
    Afterwards those parameters are ``DTensor``s sharded on dim 0 (``Shard(0)``), cut where the
    ``gradsync_core`` plan says, so ``torch.optim.*(model.parameters())``,
    ``clip_grad_norm_`` and ``state_dict()`` work on them as on FSDP2's. The forward gathers a
    unit just before it runs (prefetching the next) and frees it after
    (``reshard_after_forward``; the root stays gathered for the backward); the backward gathers
    it again (prefetching the next), reduce-scatters its gradients (averaged with FSDP2's
    arithmetic) as soon as its backward is done, and frees it.

    Args:
        module: the block or the root model, or a list of modules sharded as one unit; their
            parameters on one device, not yet sharded.
        mesh: a 1-D ``DeviceMesh`` of the data-parallel ranks (default: the world), or a 2-D
            one ``(replicate, shard)`` for hybrid sharding (HSDP; ``hsdp_mesh`` builds it
            from a ``Topology``): shard over dim 1, all-reduce gradients over dim 0.
        process_group: the data-parallel group instead of ``mesh``.
        reshard_after_forward: free the gathered parameters after forward (``False`` keeps
            them to the backward, trading memory for one all-gather).
        mp_policy: gather in ``param_dtype``, reduce in ``reduce_dtype``.

    Returns:
        ``module`` itself (the list, for the list form), each module's class now also a
        ``ShardedModule``, which is FSDP2's ``FSDPModule`` (its methods act on gradsync's units;
        docs/torch-zero3.md lists which FSDP2 methods are implemented).

    Raises:
        ValueError: the plan differs across ranks (the same sentence on every rank), the module
            is already sharded, a parameter is already a DTensor (the root sharded before its
            blocks), options conflict, or the mesh is not 1-D or 2-D. At run time, ranks that
            run the model differently (``_agreement.py``), and a non-elementwise optimizer's
            first step on the rows (``_optimizers.py``).
        RuntimeError: at run time, a collective a rank never reached, naming that rank
            (``_stall.py``).
        NotImplementedError: a weight tied across units.

    Example:
        >>> for block in model.layers:  # doctest: +SKIP
        ...     fully_shard(block)
        >>> fully_shard(model)  # doctest: +SKIP
    """
    modules = _modules(module)
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {mp_policy!r}")
    # The list form plans its modules as the children "0", "1", ... of one container (which
    # registers them without changing them), so its parameters follow FSDP2's order.
    planned = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    where = (
        type(planned).__name__
        if len(modules) == 1
        else f"[{', '.join(type(m).__name__ for m in modules)}]"
    )
    first = next(planned.parameters(), None)
    mesh = _mesh(mesh, process_group, first.device.type if first is not None else "cpu")
    layout = _layout(mesh)
    world_size = layout.shard_size
    inner = {p: u for p, m in planned.named_modules() if p and (u := unit_of(m)) is not None}
    specs = param_specs(planned)
    plan = plan_param_shards(
        specs,
        world_size=world_size * layout.replicate_size,
        units=_unit_prefixes(inner, [s.name for s in specs]),
        dp_shard=world_size,
    )
    _check_unsharded(planned, plan.units[0].params, where)
    _agree_plan(plan, layout, where)
    refuse_non_elementwise()
    params = []
    places = _places(planned, plan.units[0].params, inner)
    originals = [planned.get_parameter(name) for name in plan.units[0].params]
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
                owner=f"fully_shard({where})",
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
        modules, "", unit_params, reshard_after_forward=reshard_after_forward, policy=mp_policy
    )
    step = Step([unit])
    for planned_unit in plan.units[1:]:
        child = inner[planned_unit.prefix]
        if child in step.units:  # a list unit's other module
            continue
        # A list unit is named by all its modules' paths, as FSDP2's _module_fqn.
        child.prefix = ", ".join(p for p, c in inner.items() if c is child)
        child.is_root, child.step = False, step
        step.units.append(child)
    unit.step = step
    step.agreement.scheduled = step.can_schedule()
    unit.originals = {id(p): weakref.ref(p) for p in originals}
    for m in modules:
        m.__class__ = sharded_class(type(m))
        object.__setattr__(m, UNIT, unit)
        object.__setattr__(m, PLAN, plan)
    return module  # type: ignore[return-value]  # a list returns the list, as FSDP2's overload
