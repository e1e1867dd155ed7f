"""Parallel-group topology: Megatron-core's dense and expert rank generators (docs/design.md §5)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradsync_core.plan._canonical import PLAN_VERSION, check_header, fingerprint
from gradsync_core.plan._rank_generator import HSDP_AXES, RankGenerator

AXES = ("tp", "cp", "ep", "dp", "pp")
# Axes only the expert generator has: its tensor-parallel and data-parallel sizes.
EXPERT_ONLY_AXES = ("etp", "edp")
EXPERT_AXES = ("etp", "ep", "edp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"
# The groups a Megatron-style job creates: each axis alone, the model-parallel pair, the
# tensor+context group (sequence-sharded norms), and data+context (gradient reduction).
STANDARD_GROUPS = ("tp", "cp", "ep", "dp", "pp", "tp-cp", "dp-cp", "tp-pp", "tp-dp-cp")
# Megatron-core's expert groups (its expert generator's tp, ep, tp-ep, tp-ep-pp and dp).
EXPERT_GROUPS = ("ep", "etp", "edp", "etp-ep", "etp-ep-pp")
# Expert group names spell the expert generator's tp and dp as etp and edp.
_TO_GENERATOR = {"etp": "tp", "edp": "dp", "ep": "ep", "pp": "pp"}
_FROM_GENERATOR = {"tp": "etp", "dp": "edp", "ep": "ep", "pp": "pp", "cp": "cp"}


def _positive(name: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


@dataclass(frozen=True, slots=True, kw_only=True)
class Topology:
    """Megatron-core's two rank generators over one world: dense and expert (docs/design.md §5).

    The dense generator orders ``tp x cp x dp x pp`` (ep = 1) and names the groups of
    attention, norms and every non-expert weight: ``"tp"``, ``"cp"``, ``"dp"``, ``"pp"``,
    ``"dp-cp"``, ... The expert generator orders ``etp x ep x edp x pp`` (cp = 1) over the
    same ranks and the same ``order`` string, with ``edp = world_size // (etp * ep * pp)``;
    its groups are named ``"ep"``, ``"etp"``, ``"edp"``, ``"etp-ep"``, ``"etp-ep-pp"``
    (``EXPERT_GROUPS``). Expert parallelism is carved out of data parallelism: ``dp`` is the
    dense data-parallel size, as Megatron-core's. ``etp`` defaults to ``tp``. With ``ep = 1``
    and ``etp = tp`` every group, the JSON and the fingerprint are those of a topology
    without experts.

    Hybrid sharding (HSDP) is part of the topology, as torchtitan's ``ParallelDims``: ``dp``
    splits into ``dp_shard`` consecutive data-parallel members that cut the parameters (one
    node) and ``dp_replicate = dp // dp_shard`` groups of them that replicate it. Their groups
    are named ``"dp_shard"`` and ``"dp_replicate"`` (``"dp"`` is their union) and, under HSDP
    (``dp_shard < dp``), the mesh has the two axes in place of ``dp``, the shard axis faster.
    ``dp_shard`` defaults to ``dp`` (no HSDP), which keeps every group, the JSON and the
    fingerprint of a topology without it.

    The first token of ``order`` varies fastest: rank = sum(coord[t] * stride[t]), where
    ``stride[t]`` is the product of the sizes of the tokens before ``t``. Groups are identical
    to Megatron-core's ``RankGenerator.get_ranks``.

    Example:
        >>> topo = Topology.create(world_size=8, tp=2, cp=2)
        >>> topo.dp, topo.groups("tp-cp")
        (2, ((0, 1, 2, 3), (4, 5, 6, 7)))
        >>> moe = Topology.create(world_size=16, tp=2, ep=4)
        >>> moe.dp, moe.edp, moe.groups("ep")[0], moe.groups("edp")[0]
        (8, 2, (0, 2, 4, 6), (0, 8))
        >>> hsdp = Topology.create(world_size=8, dp_shard=4)
        >>> hsdp.dp_replicate, hsdp.groups("dp_shard"), hsdp.groups("dp_replicate")[0]
        (2, ((0, 1, 2, 3), (4, 5, 6, 7)), (0, 4))
    """

    tp: int = 1
    cp: int = 1
    ep: int = 1
    dp: int = 1
    pp: int = 1
    order: str = DEFAULT_ORDER
    etp: int | None = None  # None: the same as tp, Megatron-core's default
    dp_shard: int | None = None  # None: dp, no hybrid sharding (torchtitan's dp_shard)
    # The order as typed, before the size-1 axes were added: Megatron-core's expert generator
    # refuses an order that leaves out one of its axes of size > 1 (ep, or edp where the dense
    # dp is 1), and its errors quote what the user typed.
    _typed_order: str = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        etp = self.tp if self.etp is None else self.etp
        object.__setattr__(self, "etp", etp)
        _positive("etp", etp)
        if self.dp_shard is None:
            object.__setattr__(self, "dp_shard", self.dp)
        object.__setattr__(self, "_typed_order", self.order)
        dense = self.dense  # validates sizes and order, as Megatron's RankGenerator
        self._split_dp()  # validates dp_shard
        object.__setattr__(self, "order", dense.order)
        world, expert_model = dense.world_size, etp * self.ep * self.pp
        if world % expert_model:
            raise ValueError(
                f"etp*ep*pp = {self.etp}*{self.ep}*{self.pp} = {expert_model} does not divide "
                f"world_size = {world} (Megatron-core's expert model-parallel size); choose "
                "etp and ep whose product with pp divides it"
            )
        if self.has_experts:
            self._check_expert_layout()

    @classmethod
    def create(
        cls,
        world_size: int,
        *,
        tp: int = 1,
        cp: int = 1,
        ep: int = 1,
        pp: int = 1,
        dp: int = -1,
        order: str = DEFAULT_ORDER,
        etp: int | None = None,
        dp_shard: int | None = None,
    ) -> Topology:
        """A topology for ``world_size`` ranks, sizes inferred as Megatron-core infers them.

        ``dp=-1`` infers the dense data-parallel size ``world_size // (tp * cp * pp)``; the
        expert data-parallel size is always ``world_size // (etp * ep * pp)``. ``dp_shard``
        splits dp for hybrid sharding (HSDP): parameters are cut over ``dp_shard``
        consecutive data-parallel ranks and replicated over ``dp // dp_shard`` such groups;
        default ``dp`` (no HSDP).

        Raises:
            ValueError: if ``tp*cp*pp`` or ``etp*ep*pp`` does not divide ``world_size``, an
                explicit ``dp`` does not fill it, or ``dp_shard`` does not divide dp.

        Example:
            >>> Topology.create(world_size=16, tp=2, ep=4, etp=1).edp
            4
            >>> Topology.create(world_size=16, tp=2, dp_shard=4).mesh_sizes()
            {'pp': 1, 'dp_replicate': 2, 'dp_shard': 4, 'ep': 1, 'cp': 1, 'tp': 2}
        """
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        model = tp * cp * pp
        if dp == -1:
            if model < 1 or world_size % model:
                raise ValueError(
                    f"tp*cp*pp = {tp}*{cp}*{pp} = {model} does not divide world_size = "
                    f"{world_size} (Megatron-core's dense model-parallel size); choose sizes "
                    "whose product divides it"
                )
            dp = world_size // model
        if model * dp != world_size:
            raise ValueError(
                f"tp*cp*dp*pp = {tp}*{cp}*{dp}*{pp} = {model * dp} but world_size = "
                f"{world_size}; pass dp=-1 to infer dp (ep is carved out of dp, as in "
                "Megatron-core)"
            )
        return cls(tp=tp, cp=cp, ep=ep, dp=dp, pp=pp, order=order, etp=etp, dp_shard=dp_shard)

    @property
    def dense(self) -> RankGenerator:
        """The dense generator: ``tp x cp x dp x pp`` with ep = 1; under HSDP its dp is split
        into ``dp_shard`` and ``dp_replicate``."""
        return self._split_dp() if self.hsdp else self._split_dp(split=False)

    def _split_dp(self, *, split: bool = True) -> RankGenerator:
        """The dense generator with dp split into ``dp_shard`` x ``dp_replicate`` (also where
        ``dp_shard = dp``: the ``"dp_shard"`` and ``"dp_replicate"`` names always resolve)."""
        return RankGenerator(
            tp=self.tp,
            cp=self.cp,
            dp=self.dp,
            pp=self.pp,
            order=self.order,
            dp_shard=self.dp_shard if split else None,
        )

    @property
    def dp_replicate(self) -> int:
        """HSDP's replica groups, ``dp // dp_shard`` (1 without hybrid sharding)."""
        return self.dp // self.dp_shard  # type: ignore[operator]

    @property
    def hsdp(self) -> bool:
        """Whether data parallelism is hybrid: ``dp_shard < dp`` (the mesh splits dp)."""
        return self.dp_shard != self.dp

    @property
    def expert(self) -> RankGenerator:
        """The expert generator: ``etp x ep x edp x pp`` with cp = 1, the same order.

        Raises:
            ValueError: where Megatron-core's ``initialize_model_parallel`` refuses the
                expert layout (see ``_check_expert_layout``); checked at construction with
                experts, here without them.
        """
        if not self.has_experts:
            self._check_expert_layout()
        return self._expert_generator()

    def _expert_generator(self) -> RankGenerator:
        """The expert generator built from the order as typed, as Megatron-core builds it,
        so an axis of size > 1 left out of the order is refused, not silently appended."""
        try:
            return RankGenerator(
                tp=self.etp,  # type: ignore[arg-type]
                ep=self.ep,
                dp=self.edp,
                pp=self.pp,
                order=self._typed_order,
            )
        except ValueError as err:
            sizes = f"etp={self.etp}, ep={self.ep}, edp={self.edp}, pp={self.pp}"
            raise ValueError(
                f"Megatron-core's expert rank generator ({sizes}; its tp is etp, its dp is "
                f"edp) refuses order {self._typed_order!r}: {err}"
            ) from None

    @property
    def edp(self) -> int:
        """The expert data-parallel size, ``world_size // (etp * ep * pp)``."""
        return self.world_size // (self.etp * self.ep * self.pp)  # type: ignore[operator]

    @property
    def has_experts(self) -> bool:
        """Whether the expert layout differs from the dense one (ep > 1 or etp != tp)."""
        return self.ep > 1 or self.etp != self.tp

    def _check_expert_layout(self) -> None:
        """Megatron-core's rules for the expert generator, in the order its
        ``initialize_model_parallel`` applies them: every expert axis of size > 1 is named in
        the order as typed; with pp > 1 and an order (as typed: ``order.endswith("pp")``)
        that does not end in pp, the data-parallel sizes must agree; both generators give
        the same pipeline groups. Checked at construction with experts; without them only
        when an expert group is asked for, so topologies without experts stay valid exactly
        as before."""
        expert, typed = self._expert_generator(), self._typed_order
        if not typed.endswith("pp") and self.pp > 1 and self.edp != self.dp:
            raise ValueError(
                f"order {typed!r} does not end in 'pp', so Megatron-core needs the "
                f"expert data-parallel size ({self.edp}) to equal dp ({self.dp}); put pp last"
            )
        if self.pp > 1 and expert.groups("pp") != self.dense.groups("pp"):
            raise ValueError(
                f"pipeline groups of the dense and expert layouts differ under order "
                f"{typed!r}; put pp last in the order, as Megatron-core requires"
            )

    @property
    def tokens(self) -> tuple[str, ...]:
        return tuple(self.order.split("-"))

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def _resolve(self, name: str) -> tuple[RankGenerator, str, bool]:
        """The generator that owns group ``name``, the name in that generator's terms, and
        whether it is the expert generator."""
        axes = tuple(name.split("-")) if isinstance(name, str) else ()
        known = AXES + EXPERT_ONLY_AXES + HSDP_AXES
        if not axes or len(set(axes)) != len(axes) or any(a not in known for a in axes):
            raise ValueError(
                f"group name {name!r} must join distinct axes with '-': dense groups from "
                f"('tp', 'cp', 'dp', 'pp') and dp's HSDP parts {HSDP_AXES}, expert groups "
                f"from {EXPERT_AXES}, e.g. 'dp-cp' or 'etp-ep'"
            )
        dense_only = [a for a in axes if a in ("tp", "cp", "dp", *HSDP_AXES)]
        hsdp_parts = any(a in HSDP_AXES for a in axes)
        expert_only = [a for a in axes if a in EXPERT_ONLY_AXES]
        # Without experts ep is a size-1 axis of the dense generator, as it always was.
        if not self.has_experts and not expert_only:
            return (self._split_dp() if hsdp_parts else self.dense), name, False
        if "ep" in axes and not expert_only and not dense_only:
            expert_only = ["ep"]
        if dense_only and (expert_only or "ep" in axes):
            mixed = expert_only or ["ep"]
            raise ValueError(
                f"group {name!r} mixes dense axes {dense_only} with expert axes {mixed}: "
                "Megatron-core builds them from two rank generators; join dense axes "
                f"('tp', 'cp', 'dp', 'pp') or expert axes {EXPERT_AXES}, not both"
            )
        if expert_only:
            return self.expert, "-".join(_TO_GENERATOR[a] for a in axes), True
        return (self._split_dp() if hsdp_parts else self.dense), name, False

    def group_size(self, name: str) -> int:
        generator, local, _ = self._resolve(name)
        return generator.group_size(local)

    def coordinates(self, rank: int) -> dict[str, int]:
        """The dense coordinate of ``rank`` on every axis; ``"ep"`` is its expert-parallel
        coordinate (0 without experts), and under HSDP ``"dp_shard"`` and ``"dp_replicate"``
        split its ``"dp"``. ``expert_coordinates`` has the expert ones."""
        coords = self.dense.coordinates(rank)
        if self.ep > 1:
            coords["ep"] = self.expert.coordinates(rank)["ep"]
        return coords

    def expert_coordinates(self, rank: int) -> dict[str, int]:
        """The coordinate of ``rank`` on the expert axes ``etp``, ``ep``, ``edp``, ``pp``."""
        coords = self.expert.coordinates(rank)
        return {_FROM_GENERATOR[t]: coords[t] for t in self.tokens if t != "cp"}

    def rank_of(self, **coords: int) -> int:
        """The rank at the given dense coordinates (missing axes: 0); an ``ep`` coordinate,
        if given, must be that rank's expert-parallel coordinate."""
        ep = coords.pop("ep", None)
        if self.ep == 1 and ep is not None:
            coords["ep"] = ep
            return self.dense.rank_of(**coords)
        rank = self.dense.rank_of(**coords)
        if ep is not None and ep != self.expert.coordinates(rank)["ep"]:
            raise ValueError(
                f"coordinate ep={ep!r} does not match rank {rank}, whose expert-parallel "
                f"coordinate is {self.expert.coordinates(rank)['ep']}; leave ep out"
            )
        return rank

    def groups(self, name: str) -> tuple[tuple[int, ...], ...]:
        """Every group that varies the axes in ``name`` and fixes the rest.

        Ranks inside a group ascend; groups are listed with the first non-member axis (in
        ``order``) varying fastest — Megatron-core's order. Dense names (``"dp-cp"``) come
        from the dense generator, expert names (``"edp"``, ``"etp-ep"``) from the expert
        one. This lists all ``world_size`` ranks; for a large world ask for one group with
        ``group_at`` or ``group_of``.
        """
        generator, local, _ = self._resolve(name)
        return generator.groups(local)

    def group_count(self, name: str) -> int:
        """How many ``name`` groups partition the world: ``world_size // group_size(name)``."""
        return self.world_size // self.group_size(name)

    def rank_at(self, name: str, index: int, group_rank: int) -> int:
        """The rank at place ``group_rank`` of ``groups(name)[index]``, by arithmetic.

        Example:
            >>> Topology.create(world_size=8, tp=2, cp=2).rank_at("dp-cp", 1, 2)
            5
        """
        generator, local, _ = self._resolve(name)
        try:
            return generator.rank_at(local, index, group_rank)
        except ValueError as err:
            raise ValueError(str(err).replace(repr(local), repr(name))) from None

    def group_at(self, name: str, index: int) -> tuple[int, ...]:
        """``groups(name)[index]`` without listing the other groups."""
        return tuple(self.rank_at(name, index, place) for place in range(self.group_size(name)))

    def group_of(self, name: str, rank: int) -> tuple[int, ...]:
        """The group of ``name`` that contains ``rank``."""
        generator, local, _ = self._resolve(name)
        return generator.group_of(local, rank)

    def group_rank(self, name: str, rank: int) -> int:
        """Position of ``rank`` inside its ``name`` group (torch's group-local rank)."""
        generator, local, _ = self._resolve(name)
        return generator.group_rank(local, rank)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """Shape of ``arange(world_size).reshape(shape)``, whose fibres are the dense groups."""
        return tuple(reversed(self.dense.sizes.values()))

    @property
    def mesh_axis_names(self) -> tuple[str, ...]:
        """The dense mesh's axes, slowest first: the order reversed, and under HSDP
        ``("dp_replicate", "dp_shard")`` in dp's place (the shard axis faster)."""
        return tuple(reversed(self.dense.sizes))

    @property
    def expert_mesh_shape(self) -> tuple[int, ...]:
        """Shape of the expert mesh: the expert generator's sizes, slowest axis first."""
        return tuple(getattr(self.expert, t) for t in reversed(self.tokens) if t != "cp")

    @property
    def expert_mesh_axis_names(self) -> tuple[str, ...]:
        """``("pp", "edp", "ep", "etp")`` for the default order (cp, always 1 there, left out)."""
        return tuple(_FROM_GENERATOR[t] for t in reversed(self.tokens) if t != "cp")

    def mesh_sizes(self, *, expert: bool = False) -> dict[str, int]:
        """Axis name -> size of the dense mesh (or the expert mesh), slowest axis first:
        ``{"pp": 1, "dp": 4, "cp": 1, "tp": 2}`` for the default order."""
        if expert:
            return dict(zip(self.expert_mesh_axis_names, self.expert_mesh_shape, strict=True))
        return dict(zip(self.mesh_axis_names, self.mesh_shape, strict=True))

    def size(self, axis: str) -> int:
        """The size of one axis (``"tp"``, ``"dp"``, ``"ep"``, ``"edp"``, ``"etp"``,
        ``"dp_shard"``, ``"dp_replicate"`` ...)."""
        if axis in AXES or axis in EXPERT_ONLY_AXES or axis in HSDP_AXES:
            size: int = getattr(self, axis)
            return size
        raise ValueError(
            f"unknown axis {axis!r}; axes are {(*AXES, *EXPERT_ONLY_AXES, *HSDP_AXES)}"
        )

    def enabled(self, axis: str) -> bool:
        """Whether ``axis`` has more than one rank (torchtitan's ``*_enabled``)."""
        return self.size(axis) > 1

    def mesh_axes(self, name: str) -> tuple[str, ...]:
        """The mesh axis names of group ``name``, in mesh order (``"dp-cp"`` -> ("dp", "cp")).

        An expert group's axes are those of the expert mesh (``"etp-ep"`` -> ("ep", "etp")).
        Under HSDP ``"dp"`` is the mesh's two axes ``("dp_replicate", "dp_shard")``; without
        it ``"dp_shard"`` is the ``"dp"`` axis and ``"dp_replicate"`` (one rank) has none.
        """
        members = set(name.split("-"))
        if self.hsdp and "dp" in members:
            members |= set(HSDP_AXES)
        elif not self.hsdp and "dp_shard" in members:
            members.add("dp")
        names = self.expert_mesh_axis_names if self.is_expert_group(name) else self.mesh_axis_names
        return tuple(a for a in names if a in members)

    def is_expert_group(self, name: str) -> bool:
        """Whether the expert generator owns ``name`` (``"edp"``, ``"etp-ep"``; ``"ep"`` when
        ep > 1). Without experts both generators give the same groups.

        Raises:
            ValueError: on an invalid name, or one that mixes dense and expert axes.
        """
        return self._resolve(name)[2]

    def to_json(self) -> dict[str, Any]:
        # etp and dp_shard are written only where they differ from tp and dp, so topologies
        # without experts or HSDP keep the JSON, hence the fingerprint, of the versions
        # before expert layouts and hybrid sharding existed.
        obj = {"kind": "topology", "version": PLAN_VERSION, "order": self.order} | {
            axis: getattr(self, axis) for axis in AXES
        }
        if self.etp != self.tp:
            obj["etp"] = self.etp
        if self.hsdp:
            obj["dp_shard"] = self.dp_shard
        return obj

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> Topology:
        check_header(obj, "topology")
        return cls(
            order=obj["order"],
            etp=obj.get("etp"),
            dp_shard=obj.get("dp_shard"),
            **{axis: obj[axis] for axis in AXES},
        )

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def split_shapes(size: int, parts: int) -> tuple[int, ...]:
    """Chunk sizes for splitting a dimension of ``size`` over ``parts`` ranks.

    Chunks of ``ceil(size/parts)`` with a smaller last one; if that would leave the last
    chunk empty or negative, chunks of ``floor(size/parts)`` with a larger last one.

    Example:
        >>> split_shapes(10, 4), split_shapes(9, 4), split_shapes(5, 4)
        ((3, 3, 3, 1), (2, 2, 2, 3), (1, 1, 1, 2))

    Raises:
        ValueError: if ``size < parts`` (some rank would get nothing).
    """
    if not isinstance(parts, int) or parts < 1:
        raise ValueError(f"parts must be a positive int, got {parts!r}")
    if not isinstance(size, int) or size < parts:
        raise ValueError(
            f"cannot split a dimension of {size} over {parts} ranks: each needs at least one"
        )
    chunk = -(-size // parts)
    last = size - chunk * (parts - 1)
    if last <= 0:
        chunk = size // parts
        last = size - chunk * (parts - 1)
    return (chunk,) * (parts - 1) + (last,)
