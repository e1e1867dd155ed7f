"""Shared-parameter reductions: the extra gradient sums model parallelism needs (docs/design.md §6).

A parameter that is *not* sharded over a model-parallel axis, but is applied to tokens that
*are* split over it (a LayerNorm under context parallelism, a bias after a sequence-parallel
reduce-scatter), receives a partial gradient on each member of the axis: the true gradient is
their sum. Where the tokens are replicated instead (plain tensor parallelism, after Megatron's
copy-to operator, arXiv:1909.08053 §3), every member already holds the whole gradient and a
sum would count it ``tp`` times. So the rule is derived, never hand-marked:

    replicated_over = (axes the parameter's tokens are split over) - (axes it is sharded over)

``dp`` is left out: the data-parallel mean covers it. The loss convention that makes a *sum*
right: along a model-parallel axis that splits the tokens, each rank's loss is its share of
its replica's loss (divide by the replica's token count, not the local one), so the shares
add up to the loss.

Experts (Megatron-core's expert generator, docs/design.md §5): ``ep`` is carved out of ``dp``,
so a dense parameter replicated over ``ep`` is covered by the data-parallel mean and ``ep``
never adds a sum. An expert parameter (``ParamSpec.expert``) is held by the ``edp`` ranks of
its expert; its gradient already holds the tokens the all-to-all routed to it from ``ep``
data-parallel ranks, so it is *summed* over ``edp`` and divided by the dense ``dp`` — the
global mean over every token, Megatron-core's ``expert_gradient_scaling_factor``. Within the
expert region tensor parallelism is ``etp``: a ``"tp"`` in an expert's ``replicated_over``
becomes a sum over ``etp``; ``cp`` is folded into ``edp`` (the expert generator has cp = 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradsync_core.plan._buckets import (
    DEFAULT_CAP_BYTES,
    BucketPlan,
    check_planned_names,
    plan_buckets,
)
from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._specs import ParamSpec, check_unique_names
from gradsync_core.plan._topology import AXES, Topology

# Axes whose replicas may need an extra sum. dp is the data-parallel mean's business; pipeline
# stages hold different layers, so nothing is replicated over the whole pp axis.
MODEL_AXES = ("tp", "cp", "ep")


def _axis_list(axes: Iterable[str], what: str) -> list[str]:
    if isinstance(axes, str):
        raise TypeError(f"{what} must be a sequence of axis names such as ('cp',), got {axes!r}")
    out = list(axes)
    unknown = [a for a in out if a not in AXES]
    if unknown:
        raise ValueError(f"{what} names unknown axes {unknown}; use axes from {AXES}")
    return out


def replicated_axes(
    *, sharded_over: Iterable[str] = (), data_sharded_over: Iterable[str] = ()
) -> tuple[str, ...]:
    """The model-parallel axes over which a parameter's gradient must be summed.

    Args:
        sharded_over: axes the parameter itself is split over (a column-parallel weight:
            ``("tp",)``); these never need a sum.
        data_sharded_over: axes the tokens it is applied to are split over (``("cp",)``
            under context parallelism, plus ``"tp"`` after a sequence-parallel
            reduce-scatter); ``"dp"`` may appear and is ignored.

    Returns:
        The axes in ``data_sharded_over`` (model-parallel ones only) that are not in
        ``sharded_over``, in ``AXES`` order.

    Raises:
        ValueError: on an unknown axis, or ``"pp"`` in ``data_sharded_over``.

    Example:
        >>> replicated_axes(sharded_over=("tp",), data_sharded_over=("dp", "cp"))
        ('cp',)
        >>> replicated_axes(data_sharded_over=("cp", "tp"))  # a norm under cp + seq. parallel
        ('tp', 'cp')
    """
    sharded = set(_axis_list(sharded_over, "sharded_over"))
    data = set(_axis_list(data_sharded_over, "data_sharded_over"))
    if "pp" in data:
        raise ValueError(
            "data_sharded_over lists 'pp', but pipeline stages do not split a layer's tokens; "
            "list the axes that split them (cp, tp under sequence parallelism, ep)"
        )
    return tuple(a for a in MODEL_AXES if a in data and a not in sharded)


def reduction_group(replicated_over: Iterable[str], topology: Topology) -> str | None:
    """The group name whose sum a parameter replicated over these axes needs, or ``None``.

    Axes of size 1 in ``topology`` cost nothing and are dropped; the rest are joined in
    ``AXES`` order (``"tp-cp"``), a name ``Topology.groups`` and the executors understand.

    Raises:
        ValueError: on an unknown or repeated axis, or ``"dp"``/``"pp"``.

    Example:
        >>> topo = Topology.create(world_size=8, tp=2, cp=2)
        >>> reduction_group(("cp", "tp"), topo), reduction_group(("ep",), topo)
        ('tp-cp', None)
    """
    axes = _axis_list(replicated_over, "replicated_over")
    if len(set(axes)) != len(axes):
        raise ValueError(f"replicated_over {tuple(axes)} repeats an axis")
    bad = [a for a in axes if a not in MODEL_AXES]
    if bad:
        raise ValueError(
            f"replicated_over lists {bad}: only model-parallel axes {MODEL_AXES} belong there "
            "(the data-parallel mean already reduces over dp; pp stages hold different layers)"
        )
    # ep is part of the dense data-parallel group: the data-parallel mean covers it.
    live = [a for a in MODEL_AXES if a in axes and a != "ep" and topology.enabled(a)]
    return "-".join(live) or None


def expert_reduction_group(replicated_over: Iterable[str], topology: Topology) -> str | None:
    """The extra-sum group of an *expert* parameter: ``"etp"`` if it is replicated over
    ``"tp"`` and ``topology.etp > 1``, else ``None`` (cp and ep are covered by ``edp``).

    Example:
        >>> expert_reduction_group(("tp", "cp"), Topology.create(8, tp=2, ep=2))
        'etp'
    """
    reduction_group(replicated_over, topology)  # validates the names
    return "etp" if "tp" in replicated_over and topology.size("etp") > 1 else None


@dataclass(frozen=True, slots=True, kw_only=True)
class SharedReduction:
    """The buckets of parameters whose gradients are summed over one group."""

    group: str  # a Topology group name, "cp" or "tp-cp"; "edp" for expert gradients
    buckets: BucketPlan
    # Divide the sum by this: the dense dp for the expert data-parallel reduction, else 1.
    divisor: int = 1

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.buckets.slots)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReductionPlan:
    """Every extra gradient sum of a model, one ``SharedReduction`` per group.

    Members of one group hold the same parameters with the same shapes (that is what
    replicated means), so each group's buckets agree across its members even when shapes
    differ between groups (uneven tensor-parallel splits).
    """

    topology: Topology
    reductions: tuple[SharedReduction, ...]

    def check_names(self, names: Iterable[str], *, where: str) -> None:
        """Refuse a plan that names a parameter ``names`` lacks (``BucketPlan.check_names``).

        Raises:
            ValueError: naming the first planned parameter that is missing.
        """
        planned = (name for reduction in self.reductions for name in reduction.names)
        check_planned_names("reduction plan", planned, names, where)

    @property
    def group_names(self) -> tuple[str, ...]:
        return tuple(r.group for r in self.reductions)

    def group_of(self, name: str) -> str | None:
        """The group parameter ``name`` is summed over, ``None`` if it needs no sum."""
        for reduction in self.reductions:
            if name in reduction.names:
                return reduction.group
        return None

    def reduction(self, group: str) -> SharedReduction:
        for reduction in self.reductions:
            if reduction.group == group:
                return reduction
        raise KeyError(f"this plan has no reduction over group {group!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "reduction_plan",
            "version": PLAN_VERSION,
            "topology": self.topology.to_json(),
            # divisor is written only where it is not 1, so plans without experts keep the
            # JSON and fingerprint they had before experts existed.
            "reductions": [
                {"group": r.group, "buckets": r.buckets.to_json()}
                | ({"divisor": r.divisor} if r.divisor != 1 else {})
                for r in self.reductions
            ],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ReductionPlan:
        check_header(obj, "reduction_plan")
        return cls(
            topology=Topology.from_json(obj["topology"]),
            reductions=tuple(
                SharedReduction(
                    group=r["group"],
                    buckets=BucketPlan.from_json(r["buckets"]),
                    divisor=r.get("divisor", 1),
                )
                for r in obj["reductions"]
            ),
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


_EXPERT_GROUP_ORDER = ("etp", "edp")  # after every dense group


def _group_key(group: str) -> tuple[int, int, tuple[int, ...]]:
    if group in _EXPERT_GROUP_ORDER:
        return 1, _EXPERT_GROUP_ORDER.index(group), ()
    axes = group.split("-")
    return 0, len(axes), tuple(MODEL_AXES.index(a) for a in axes)


def plan_shared_reductions(
    specs: Sequence[ParamSpec],
    topology: Topology,
    *,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int | None = None,
) -> ReductionPlan:
    """Bucket the extra sums of every trainable parameter with a non-empty reduction group.

    Parameters are grouped by ``reduction_group(spec.replicated_over, topology)`` (expert
    ones by ``expert_reduction_group``, and every expert one also into ``"edp"``, summed and
    divided by ``topology.dp``: see the module docstring); each group's
    parameters get ``plan_buckets`` buckets (DDP's rule, registration order, bucket 0 = last
    registered = first ready). Groups are listed single axes first, each in ``AXES`` order
    (``tp``, ``cp``, ``ep``, ``tp-cp``, ...), the same on every rank.

    Raises:
        ValueError: on duplicate names or an invalid ``replicated_over`` (see
            ``reduction_group``).

    Example:
        >>> topo = Topology.create(world_size=4, tp=2, cp=2)
        >>> specs = [ParamSpec(name="fc.weight", shape=(4, 8), replicated_over=("cp",)),
        ...          ParamSpec(name="norm.weight", shape=(8,), replicated_over=("tp", "cp")),
        ...          ParamSpec(name="head.weight", shape=(8, 8))]
        >>> plan = plan_shared_reductions(specs, topo)
        >>> plan.group_names, plan.group_of("norm.weight"), plan.group_of("head.weight")
        (('cp', 'tp-cp'), 'tp-cp', None)
    """
    check_unique_names(specs)
    by_group: dict[str, list[ParamSpec]] = {}
    for spec in specs:
        try:
            if spec.expert:
                group = expert_reduction_group(spec.replicated_over, topology)
            else:
                group = reduction_group(spec.replicated_over, topology)
        except ValueError as err:
            raise ValueError(f"parameter {spec.name!r}: {err}") from None
        if not spec.requires_grad:
            continue
        if group is not None:
            by_group.setdefault(group, []).append(spec)
        if spec.expert:
            # Planned even where edp = 1: the division by dp is still owed.
            by_group.setdefault("edp", []).append(spec)
    return ReductionPlan(
        topology=topology,
        reductions=tuple(
            SharedReduction(
                group=group,
                buckets=plan_buckets(
                    by_group[group], cap_bytes=cap_bytes, first_cap_bytes=first_cap_bytes
                ),
                divisor=topology.dp if group == "edp" else 1,
            )
            for group in sorted(by_group, key=_group_key)
        ),
    )


def split_expert_specs(specs: Sequence[ParamSpec]) -> tuple[list[ParamSpec], list[ParamSpec]]:
    """``(dense, expert)``: the dense parameters, whose data-parallel mean and ZeRO owners
    are planned over ``dp``, and the expert ones, reduced by the plan's ``"edp"`` reduction
    and owned over ``edp`` (``plan_greedy_shards(expert, world_size=topology.edp)``).

    Example:
        >>> router, w = ParamSpec(name="router", shape=(4,)), ParamSpec(name="w", shape=(4,))
        >>> dense, expert = split_expert_specs([router, replace(w, expert=True)])
        >>> [s.name for s in dense], [s.name for s in expert]
        (['router'], ['w'])
    """
    return [s for s in specs if not s.expert], [s for s in specs if s.expert]


def with_replicated_over(
    specs: Sequence[ParamSpec], replicated_over: Mapping[str, Iterable[str]]
) -> list[ParamSpec]:
    """Copies of ``specs`` with ``replicated_over`` set from a name -> axes mapping.

    Raises:
        ValueError: if the mapping names a parameter that is not in ``specs``.

    Example:
        >>> [s.replicated_over for s in with_replicated_over(
        ...     [ParamSpec(name="w", shape=(2,))], {"w": ("cp",)})]
        [('cp',)]
    """
    known = {spec.name for spec in specs}
    unknown = sorted(set(replicated_over) - known)
    if unknown:
        raise ValueError(f"replicated_over names {unknown}, which are not parameters here")
    return [
        replace(spec, replicated_over=tuple(replicated_over.get(spec.name, ()))) for spec in specs
    ]
