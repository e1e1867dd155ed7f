"""Bucket layouts: which gradients travel together in one collective (docs/design.md §3)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._specs import ParamSpec, check_unique_names, itemsize, trainable

MIB = 1024 * 1024
DEFAULT_CAP_BYTES = 25 * MIB
# DDP's small first bucket (torch.distributed._DEFAULT_FIRST_BUCKET_BYTES): it holds the
# earliest-registered parameters, reduced last, so the tail after backward stays short.
DEFAULT_FIRST_CAP_BYTES = 1 * MIB
# fairseq's LegacyDistributedDataParallel reuses one flat buffer of this many elements.
DEFAULT_LEGACY_MAX_NUMEL = 2**28


def bucket_caps(bucket_cap_mb: float | None) -> tuple[int, int]:
    """DDP's cap convention as ``(cap_bytes, first_cap_bytes)``: no cap given -> 25 MiB
    buckets with a 1 MiB first bucket; a cap given -> that cap for every bucket."""
    if bucket_cap_mb is None:
        return DEFAULT_CAP_BYTES, DEFAULT_FIRST_CAP_BYTES
    cap = max(1, int(bucket_cap_mb * MIB))
    return cap, cap


def legacy_max_numel(specs: Sequence[ParamSpec], bucket_cap_mb: float | None) -> int:
    """The explicit sync's reused buffer in elements (``plan_legacy_buckets``' ``max_numel``):
    ``DEFAULT_LEGACY_MAX_NUMEL`` without a cap, else the cap in elements of the widest
    trainable dtype (fairseq's ``buffer_size``; gradsync_torch's ``DataParallel(overlap=False)``).

    Example:
        >>> legacy_max_numel([ParamSpec(name="w", shape=(4,))], 1.0)  # 1 MiB of fp32
        262144
    """
    if bucket_cap_mb is None:
        return DEFAULT_LEGACY_MAX_NUMEL
    widest = max((itemsize(s.dtype) for s in specs if s.requires_grad), default=4)
    return max(1, int(bucket_cap_mb * MIB) // widest)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slot:
    """Where one parameter's gradient lives inside its bucket's flat buffer."""

    name: str
    shape: tuple[int, ...]
    bucket: int
    offset: int  # elements from the bucket start, already aligned

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True, slots=True, kw_only=True)
class Bucket:
    """One flat buffer: gradients of one (dtype, device), reduced by one collective."""

    index: int
    dtype: str
    device: str
    numel: int  # length of the flat buffer, padding included
    limit_bytes: int  # the cap in force when the bucket closed (DDP's per-bucket size limit)
    slots: tuple[Slot, ...]

    @property
    def used_numel(self) -> int:
        """Elements that hold gradients (the rest is alignment and padding)."""
        return sum(slot.numel for slot in self.slots)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True, kw_only=True)
class BucketPlan:
    """A frozen bucket layout; bucket 0 is reduced first.

    ``order`` says how the layout was built: ``"registration"`` (DDP's initial assignment),
    ``"observed"`` (rebuilt from a gradient-ready order) or ``"legacy"`` (one reused buffer
    of at most ``cap_bytes // itemsize`` elements, synced after backward).
    """

    buckets: tuple[Bucket, ...]
    cap_bytes: int
    first_cap_bytes: int
    align: int
    pad_to: int
    order: str

    @property
    def slots(self) -> tuple[Slot, ...]:
        return tuple(slot for bucket in self.buckets for slot in bucket.slots)

    def slot(self, name: str) -> Slot:
        """The slot of parameter ``name``; ``KeyError`` if it has none (frozen or unknown)."""
        for bucket in self.buckets:
            for slot in bucket.slots:
                if slot.name == name:
                    return slot
        raise KeyError(f"parameter {name!r} has no slot in this bucket plan")

    @property
    def numel(self) -> int:
        return sum(bucket.numel for bucket in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(bucket.nbytes for bucket in self.buckets)

    def check_names(self, names: Iterable[str], *, where: str) -> None:
        """Refuse a plan that names a parameter ``names`` lacks (``where`` says what
        ``names`` are: ``"a leaf of grads"``, ``"a parameter of this model"``).

        Raises:
            ValueError: naming the first planned parameter that is missing.
        """
        check_planned_names("bucket plan", (slot.name for slot in self.slots), names, where)

    def renamed(
        self,
        names: Mapping[str, str],
        *,
        shapes: Mapping[str, tuple[int, ...]] | None = None,
    ) -> BucketPlan:
        """This layout with its slots renamed by ``names`` (old -> new; a slot missing from it
        keeps its name) and reshaped by ``shapes`` (old name -> new shape, same numel).

        Offsets and bucket lengths stay: the buffer is the same, only what its slots are
        called changes (torch's ``fc.weight (out, in)`` for Flax's ``Dense_0/kernel (in, out)``).

        Raises:
            ValueError: if two slots get one name, or a new shape has another element count.

        Example:
            >>> plan = plan_buckets([ParamSpec(name="k", shape=(3, 2))])
            >>> [(s.name, s.shape) for s in plan.renamed({"k": "w"}, shapes={"k": (2, 3)}).slots]
            [('w', (2, 3))]
        """
        shapes = shapes or {}
        buckets = []
        for bucket in self.buckets:
            slots = []
            for slot in bucket.slots:
                shape = tuple(shapes.get(slot.name, slot.shape))
                if math.prod(shape) != slot.numel:
                    raise ValueError(
                        f"slot {slot.name!r} has shape {slot.shape} ({slot.numel} elements) but "
                        f"the new shape {shape} has {math.prod(shape)}; a rename keeps the "
                        "buffer, so pass a shape with the same element count"
                    )
                slots.append(replace(slot, name=names.get(slot.name, slot.name), shape=shape))
            buckets.append(replace(bucket, slots=tuple(slots)))
        check_distinct_renames([slot.name for bucket in buckets for slot in bucket.slots])
        return replace(self, buckets=tuple(buckets))

    def padded(self, multiple: int) -> BucketPlan:
        """This layout with every bucket's length rounded up to a multiple of
        ``lcm(pad_to, multiple)`` (a reduce-scatter over ``multiple`` ranks needs it); slots
        and offsets stay, only padding is added at the end of each bucket.

        Raises:
            ValueError: if ``multiple`` is not a positive int.
        """
        check_positive(multiple=multiple)
        pad_to = math.lcm(self.pad_to, multiple)
        buckets = tuple(replace(b, numel=_round_up(b.numel, pad_to)) for b in self.buckets)
        return replace(self, buckets=buckets, pad_to=pad_to)

    @staticmethod
    def concat(plans: Sequence[BucketPlan]) -> BucketPlan:
        """One layout holding the buckets of ``plans`` in order, re-indexed; the caps,
        alignment and order are the first plan's (parameters added to an optimizer later get
        buckets of their own and leave the earlier ones alone).

        Raises:
            ValueError: if ``plans`` is empty.
        """
        if not plans:
            raise ValueError("concat needs at least one bucket plan")
        buckets: list[Bucket] = []
        for plan in plans:
            for bucket in plan.buckets:
                index = len(buckets)
                slots = tuple(replace(s, bucket=index) for s in bucket.slots)
                buckets.append(replace(bucket, index=index, slots=slots))
        return replace(plans[0], buckets=tuple(buckets))

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "bucket_plan",
            "version": PLAN_VERSION,
            "cap_bytes": self.cap_bytes,
            "first_cap_bytes": self.first_cap_bytes,
            "align": self.align,
            "pad_to": self.pad_to,
            "order": self.order,
            "buckets": [
                {
                    "dtype": b.dtype,
                    "device": b.device,
                    "numel": b.numel,
                    "limit_bytes": b.limit_bytes,
                    # [name, shape, offset]: compact, since plans can hold 10^5 slots.
                    "slots": [[s.name, list(s.shape), s.offset] for s in b.slots],
                }
                for b in self.buckets
            ],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> BucketPlan:
        check_header(obj, "bucket_plan")
        buckets = tuple(
            Bucket(
                index=i,
                dtype=b["dtype"],
                device=b["device"],
                numel=b["numel"],
                limit_bytes=b["limit_bytes"],
                slots=tuple(
                    Slot(name=name, shape=tuple(shape), bucket=i, offset=offset)
                    for name, shape, offset in b["slots"]
                ),
            )
            for i, b in enumerate(obj["buckets"])
        )
        return cls(
            buckets=buckets,
            cap_bytes=obj["cap_bytes"],
            first_cap_bytes=obj["first_cap_bytes"],
            align=obj["align"],
            pad_to=obj["pad_to"],
            order=obj["order"],
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def check_planned_names(
    kind: str, planned: Iterable[str], names: Iterable[str], where: str
) -> None:
    """The one "plan names a parameter the model lacks" rule of every plan kind: a planned
    parameter without a gradient would leave a collective's members disagreeing."""
    known = set(names)
    for name in planned:
        if name not in known:
            raise ValueError(
                f"the {kind} names {name!r}, which is not {where}; build the plan from the same "
                "model (every planned parameter must get a gradient, zeros if unused)"
            )


def check_distinct_renames(names: Sequence[str]) -> None:
    """Raise ``ValueError`` if a rename gave two parameters one name."""
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(
                f"the rename gives two parameters the name {name!r}; map every parameter "
                "to its own name"
            )
        seen.add(name)


def check_positive(**values: int) -> None:
    """Refuse any of ``values`` that is not a positive int (a bool is not an int here)."""
    for key, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{key} must be a positive int, got {value!r}")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _group_by_limits(
    walk: Sequence[ParamSpec], limits: Sequence[int]
) -> list[tuple[list[int], int]]:
    """DDP's rule (reducer.cpp ``compute_bucket_assignment_by_size``) over positions in ``walk``.

    Each (dtype, device) key keeps an open bucket and its own position in ``limits``; a bucket
    closes once its bytes reach the limit, so it can overflow by its last tensor only.
    Returns (positions, limit) per bucket: closed buckets in closing order, then the
    still-open ones.
    """
    # key -> [open positions, open bytes, index into limits]
    state: dict[tuple[str, str], list[Any]] = {}
    closed: list[tuple[list[int], int]] = []
    for position, spec in enumerate(walk):
        key = (spec.dtype, spec.device)
        entry = state.get(key)
        if entry is None:
            entry = state[key] = [[], 0, 0]
        entry[0].append(position)
        entry[1] += spec.nbytes
        if entry[1] >= limits[entry[2]]:
            closed.append((entry[0], limits[entry[2]]))
            entry[0], entry[1] = [], 0
            entry[2] = min(entry[2] + 1, len(limits) - 1)
    closed.extend((positions, limits[k]) for positions, _, k in state.values() if positions)
    return closed


def _layout(
    groups: Sequence[tuple[Sequence[ParamSpec], int]],
    *,
    cap_bytes: int,
    first_cap_bytes: int,
    align: int,
    pad_to: int,
    order: str,
) -> BucketPlan:
    buckets = []
    for index, (group, limit) in enumerate(groups):
        slots = []
        offset = 0
        for spec in group:
            if align > 1:
                offset = _round_up(offset, align)
            slots.append(Slot(name=spec.name, shape=spec.shape, bucket=index, offset=offset))
            offset += spec.numel
        buckets.append(
            Bucket(
                index=index,
                dtype=group[0].dtype,
                device=group[0].device,
                numel=_round_up(offset, pad_to),
                limit_bytes=limit,
                slots=tuple(slots),
            )
        )
    return BucketPlan(
        buckets=tuple(buckets),
        cap_bytes=cap_bytes,
        first_cap_bytes=first_cap_bytes,
        align=align,
        pad_to=pad_to,
        order=order,
    )


def plan_buckets(
    specs: Sequence[ParamSpec],
    *,
    cap_bytes: int = DEFAULT_CAP_BYTES,
    first_cap_bytes: int | None = None,
    align: int = 1,
    pad_to: int = 1,
) -> BucketPlan:
    """PyTorch DDP's bucket assignment for parameters in registration order.

    Walks the trainable parameters in order with limits ``[first_cap_bytes, cap_bytes, ...]``
    per (dtype, device), then sorts the buckets by their smallest parameter index and
    reverses them: bucket 0 holds the last-registered parameters, whose gradients are ready
    first in backward. With ``align == pad_to == 1`` the buckets equal
    ``reversed(torch.distributed._compute_bucket_assignment_by_size(params, limits))``.

    Args:
        specs: every parameter in registration order; frozen ones get no slot.
        cap_bytes: the limit of every bucket after the first (DDP default: 25 MiB).
        first_cap_bytes: the limit of the first bucket walked; ``None`` means ``cap_bytes``
            (DDP uses 1 MiB, ``DEFAULT_FIRST_CAP_BYTES``, when the user sets no cap).
        align: every slot offset is rounded up to a multiple of this many elements.
        pad_to: every bucket length is rounded up to a multiple of this (use a multiple of
            the data-parallel size for reduce-scatter; Megatron uses ``lcm(dp, 128)``).

    Returns:
        The plan. The cap rule reads the parameters' own bytes, not the aligned ones, so
        alignment never changes which parameters share a bucket.

    Raises:
        ValueError: on duplicate names or non-positive sizes.

    Example:
        >>> specs = [ParamSpec(name=f"w{i}", shape=(256, 256)) for i in range(4)]
        >>> [len(b.slots) for b in plan_buckets(specs, cap_bytes=2 * 256 * 256 * 4).buckets]
        [2, 2]
    """
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    check_positive(cap_bytes=cap_bytes, first_cap_bytes=first, align=align, pad_to=pad_to)
    check_unique_names(specs)
    walk = [spec for _, spec in trainable(specs)]
    groups = _group_by_limits(walk, [first, cap_bytes])
    # Positions in ``walk`` grow with registration index, so min(group) is group[0].
    groups.sort(key=lambda group: group[0][0], reverse=True)
    return _layout(
        [([walk[p] for p in positions], limit) for positions, limit in groups],
        cap_bytes=cap_bytes,
        first_cap_bytes=first,
        align=align,
        pad_to=pad_to,
        order="registration",
    )


def plan_param_buckets(specs: Sequence[ParamSpec], *, pad_to: int = 1) -> BucketPlan:
    """One bucket per trainable parameter, each padded to a multiple of ``pad_to``.

    The layout of the flat partition "by parameter" (``shard_optimizer``'s ``auto`` for an
    elementwise optimizer, docs/design.md §4): rank ``r`` holds element range ``r`` of every
    parameter, so nothing is packed per step and a mask or label decides per parameter.
    Refuses a zero-size parameter, which has no element range (``plan_buckets`` would put it
    into its neighbour's bucket).

    Example:
        >>> from gradsync_core import ParamSpec
        >>> specs = [ParamSpec(name="w", shape=(3, 2)), ParamSpec(name="b", shape=(3,))]
        >>> plan = plan_param_buckets(specs, pad_to=4)
        >>> [([s.name for s in b.slots], b.numel) for b in plan.buckets]
        [(['b'], 4), (['w'], 8)]
    """
    empty = [spec.name for spec in specs if spec.requires_grad and spec.numel == 0]
    if empty:
        raise ValueError(
            f"parameters {empty} have zero elements, so one bucket per parameter cannot give "
            "them an element range; leave them out or use the bucketed flat partition"
        )
    # A one-byte cap closes every bucket after its first parameter: one parameter each.
    return plan_buckets(specs, cap_bytes=1, pad_to=pad_to)


def rebuild_buckets(
    plan: BucketPlan, specs: Sequence[ParamSpec], ready_order: Sequence[str]
) -> BucketPlan:
    """Rebuild ``plan`` from an observed gradient-ready order (DDP's bucket rebuild).

    Walks ``ready_order`` with the same cap rule and keeps buckets in the order they become
    complete, so bucket 0 is the first one ready. Trainable parameters missing from the
    order (no gradient in the observed step) are appended in reverse registration order, the
    order backward usually produces. Every rank must adopt the same order (rank 0's) or
    collectives mismatch.

    Raises:
        ValueError: if ``ready_order`` names an unknown or frozen parameter, or one twice.
    """
    by_name = {spec.name: spec for _, spec in trainable(specs)}
    seen: set[str] = set()
    for name in ready_order:
        if name not in by_name:
            raise ValueError(
                f"ready order names {name!r}, which is not a trainable parameter of this model"
            )
        if name in seen:
            raise ValueError(f"ready order names {name!r} twice")
        seen.add(name)
    walk = [by_name[name] for name in ready_order]
    walk += [by_name[name] for name in reversed(by_name) if name not in seen]
    groups = _group_by_limits(walk, [plan.first_cap_bytes, plan.cap_bytes])
    groups.sort(key=lambda group: group[0][-1])  # a bucket is complete when its last is ready
    return _layout(
        [([walk[p] for p in positions], limit) for positions, limit in groups],
        cap_bytes=plan.cap_bytes,
        first_cap_bytes=plan.first_cap_bytes,
        align=plan.align,
        pad_to=plan.pad_to,
        order="observed",
    )


def plan_legacy_buckets(
    specs: Sequence[ParamSpec],
    *,
    max_numel: int = DEFAULT_LEGACY_MAX_NUMEL,
    align: int = 1,
    pad_to: int = 1,
) -> BucketPlan:
    """The explicit-sync layout of fairseq's ``LegacyDistributedDataParallel``.

    Parameters are packed in registration order into one reusable buffer of ``max_numel``
    elements per (dtype, device): a bucket is flushed *before* it would overflow, and a
    parameter larger than the buffer travels alone. Buckets are in registration order; the
    sync runs after backward, so their order does not matter for overlap.

    Example:
        >>> specs = [ParamSpec(name=f"w{i}", shape=(10,)) for i in range(5)]
        >>> [len(b.slots) for b in plan_legacy_buckets(specs, max_numel=20).buckets]
        [2, 2, 1]
    """
    check_positive(max_numel=max_numel, align=align, pad_to=pad_to)
    check_unique_names(specs)
    walk = [spec for _, spec in trainable(specs)]
    open_buckets: dict[tuple[str, str], list[int]] = {}
    open_numel: dict[tuple[str, str], int] = {}
    groups: list[list[int]] = []
    for position, spec in enumerate(walk):
        key = (spec.dtype, spec.device)
        if spec.numel >= max_numel:
            groups.append([position])
            continue
        if open_numel.get(key, 0) + spec.numel > max_numel:
            groups.append(open_buckets.pop(key))
            open_numel[key] = 0
        open_buckets.setdefault(key, []).append(position)
        open_numel[key] = open_numel.get(key, 0) + spec.numel
    groups.extend(open_buckets.values())
    groups.sort(key=lambda positions: positions[0])
    # Record the buffer size as bytes of the widest dtype so the plan states its cap.
    widest = max((itemsize(spec.dtype) for spec in walk), default=4)
    return _layout(
        [
            ([walk[p] for p in positions], max_numel * itemsize(walk[positions[0]].dtype))
            for positions in groups
        ],
        cap_bytes=max_numel * widest,
        first_cap_bytes=max_numel * widest,
        align=align,
        pad_to=pad_to,
        order="legacy",
    )


def describe_difference(mine: BucketPlan, theirs: BucketPlan) -> str:
    """One sentence naming the first place two plans differ ("" if they are equal).

    Executors gather every rank's plan when fingerprints disagree and report this, so a
    user reads which parameter differs instead of debugging a hung collective.
    """
    for field in ("cap_bytes", "first_cap_bytes", "align", "pad_to", "order"):
        a, b = getattr(mine, field), getattr(theirs, field)
        if a != b:
            return f"{field} differs: {a!r} vs {b!r}"
    a_slots, b_slots = mine.slots, theirs.slots
    for position, (a, b) in enumerate(zip(a_slots, b_slots, strict=False)):
        a_bucket, b_bucket = mine.buckets[a.bucket], theirs.buckets[b.bucket]
        if (a.name, a.shape, a_bucket.dtype) != (b.name, b.shape, b_bucket.dtype):
            return (
                f"parameter #{position} differs: {a.name!r} {a.shape} {a_bucket.dtype} "
                f"vs {b.name!r} {b.shape} {b_bucket.dtype}"
            )
    if len(a_slots) != len(b_slots):
        longer, plan = (a_slots, "first") if len(a_slots) > len(b_slots) else (b_slots, "second")
        extra = longer[min(len(a_slots), len(b_slots))]
        return (
            f"the {plan} plan has {abs(len(a_slots) - len(b_slots))} more trainable "
            f"parameter(s), starting with {extra.name!r}"
        )
    for a_bucket, b_bucket in zip(mine.buckets, theirs.buckets, strict=True):
        if a_bucket != b_bucket:
            return (
                f"bucket {a_bucket.index} differs: {len(a_bucket.slots)} parameters, "
                f"{a_bucket.numel} elements vs {len(b_bucket.slots)}, {b_bucket.numel}"
            )
    return ""
