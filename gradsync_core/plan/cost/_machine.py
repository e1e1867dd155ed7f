"""The machine profile: each collective's time as latency + bytes / bus bandwidth (α-β).

nccl-tests reports a collective of ``S`` bytes over ``n`` ranks that took ``t`` seconds as its
*bus bandwidth* ``busbw = S / t * factor(n)``, with the factor that makes the figure comparable
across group sizes and with the hardware's link speed: ``2(n-1)/n`` for an all-reduce (a ring
sends and receives every byte twice, less its own share), ``(n-1)/n`` for an all-gather or a
reduce-scatter (``S`` is the gathered size), 1 for a broadcast and a point-to-point send
(nccl-tests' ``doc/PERFORMANCE.md``). The profile stores, per collective kind, group size and
level (inside one node or across nodes), the latency ``α`` and that bus bandwidth, so

    time(S, n) = α + factor(n) * S / busbw

On top of the wire, an executor spends host time on each collective it issues (its hooks,
bookkeeping and the ranks' skew at the collective): ``host_s`` per collective kind, and
``step_host_s`` once per step per executor path (``"data_parallel"``, ``"zero3"``: the sync's
bookkeeping collectives and checks). The timelines put both on the compute stream, where they
delay the next compute; the wire time overlaps it.

``gradsync calibrate`` measures one (``fit_link`` fits the samples); a hand-written one works
the same (docs/cost-model.md has an H100 NVLink node and an InfiniBand cluster).
"""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from gradsync_core.plan._canonical import fingerprint

ALL_REDUCE = "all_reduce"
ALL_GATHER = "all_gather"
REDUCE_SCATTER = "reduce_scatter"
# The reduce-scatter of a ZeRO-2 gradient bucket into a preallocated shard: an executor may run
# it another way than its plain reduce-scatter (gradsync_torch's ``reduce_scatter_into`` on
# gloo: a pairwise exchange at 2 ranks, one reduce per owner above, where ``fully_shard`` runs
# ``reduce_scatter_tensor`` as FSDP2 does). A profile without its own entries for it costs it
# as ``reduce_scatter`` (``STANDS_IN``).
BUCKET_REDUCE_SCATTER = "bucket_reduce_scatter"
BROADCAST = "broadcast"
P2P = "p2p"
COLLECTIVES = (ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER, BUCKET_REDUCE_SCATTER, BROADCAST, P2P)
STANDS_IN = {BUCKET_REDUCE_SCATTER: REDUCE_SCATTER}  # a kind the profile lacks: read this one
NODE, NETWORK = "node", "network"  # a group inside one node, or spanning nodes
LEVELS = (NODE, NETWORK)
MACHINE_PROFILE_KIND = "machine_profile"
MACHINE_PROFILE_VERSION = 6  # the schema's own version, not the plans'
# Version 1 had no host overheads, version 2 no slowdown per collective kind, version 3 one
# line per link (no ``pieces``) and no pipeline message posts (``post_s``), version 4 no
# packing curves (``pack_s``), version 5 no ``bucket_reduce_scatter`` and no ``cores``: they
# still load, with none (that kind then costs as ``reduce_scatter``).
MACHINE_PROFILE_VERSIONS = (1, 2, 3, 4, 5, 6)
DATA_PARALLEL, ZERO3 = "data_parallel", "zero3"
STEP_PATHS = (DATA_PARALLEL, ZERO3)  # the executor paths with a per-step host overhead
SEND, RECEIVE = "send", "receive"
POSTS = (SEND, RECEIVE)  # a pipeline message's two posts (``post_s``)


def bus_factor(collective: str, group_size: int) -> float:
    """nccl-tests' bus-bandwidth factor of ``collective`` over ``group_size`` ranks.

    Raises:
        ValueError: an unknown collective or a group size below 1.

    Example:
        >>> bus_factor("all_reduce", 4), bus_factor("all_gather", 4), bus_factor("p2p", 2)
        (1.5, 0.75, 1.0)
    """
    _check_collective(collective)
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    n = group_size
    if collective == ALL_REDUCE:
        return 2 * (n - 1) / n
    if collective in (ALL_GATHER, REDUCE_SCATTER, BUCKET_REDUCE_SCATTER):
        return (n - 1) / n
    return 1.0


def _entry(table: Mapping[str, float], collective: str, default: float) -> float:
    """``table``'s figure for ``collective``, else its stand-in's (``STANDS_IN``), else
    ``default``."""
    if collective in table:
        return table[collective]
    return table.get(STANDS_IN.get(collective, collective), default)


def _check_collective(collective: str) -> None:
    if collective not in COLLECTIVES:
        raise ValueError(f"unknown collective {collective!r}; use one of {', '.join(COLLECTIVES)}")


def _finite(name: str, value: object, *, positive: bool) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (positive and value == 0):  # type: ignore[operator]
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return float(value)  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True, kw_only=True)
class LinkCost:
    """The α-β cost of one collective kind over groups of one size at one level.

    ``group_size`` ``None`` covers every size that has no entry of its own (bus bandwidth is
    what stays constant across sizes; the latency then is the one given). ``issue_s`` and
    ``issue_bandwidth`` are what starting one costs the thread that issues it (the time an
    asynchronous call takes to return: gloo copies the input on the caller's thread, NCCL
    enqueues a kernel in microseconds); the defaults say it costs nothing.

    ``pieces`` makes the line piecewise where one line across sizes does not hold (XLA:CPU's
    all-reduce of 16 MiB takes 30 times its 1 MiB one, not 16): ``((from_bytes,
    bus_bandwidth), ...)``, ascending, each the bus bandwidth of the bytes above
    ``from_bytes`` up to the next piece's start. The time stays continuous and grows with the
    size: the base line (``latency_s``, ``bus_bandwidth``) up to the first piece, then each
    piece's bandwidth for its own bytes, the way nccl-tests reports a bus bandwidth per size.

    Example:
        >>> link = LinkCost(collective="p2p", group_size=2, latency_s=0.0, bus_bandwidth=1e9,
        ...                 pieces=((10**6, 5e8),))
        >>> round(link.time(10**6, 2) * 1e3, 3), round(link.time(2 * 10**6, 2) * 1e3, 3)
        (1.0, 3.0)
    """

    collective: str
    group_size: int | None
    level: str = NODE
    latency_s: float  # α: the time of a collective of 0 bytes
    bus_bandwidth: float  # bytes per second, nccl-tests' busbw
    issue_s: float = 0.0
    issue_bandwidth: float | None = None
    pieces: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_collective(self.collective)
        if self.group_size is not None:
            bus_factor(self.collective, self.group_size)  # a positive int
        if self.level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {self.level!r}")
        _finite("latency_s", self.latency_s, positive=False)
        _finite("bus_bandwidth", self.bus_bandwidth, positive=True)
        _finite("issue_s", self.issue_s, positive=False)
        if self.issue_bandwidth is not None:
            _finite("issue_bandwidth", self.issue_bandwidth, positive=True)
        _check_sized(self.pieces, "a link's pieces", "(from_bytes, bus_bandwidth)", positive=True)

    def time(self, nbytes: int, group_size: int) -> float:
        """Seconds for ``nbytes`` (the whole buffer: the gathered size of an all-gather, the
        input of a reduce-scatter) over ``group_size`` ranks; 0 for a group of one."""
        if group_size == 1 and self.collective != P2P:
            return 0.0
        # bytes up to each piece's start go at the bandwidth before it, the rest at its own
        ends = [start for start, _ in self.pieces] + [max(nbytes, 0)]
        bandwidths = [self.bus_bandwidth] + [bw for _, bw in self.pieces]
        wire, done = 0.0, 0
        for end, bandwidth in zip(ends, bandwidths, strict=True):
            part = min(nbytes, end) - done
            if part <= 0:
                break
            wire += part / bandwidth
            done += part
        return self.latency_s + bus_factor(self.collective, group_size) * wire

    def issue_time(self, nbytes: int) -> float:
        """Seconds the issuing thread spends starting a collective of ``nbytes``."""
        per_byte = 0.0 if self.issue_bandwidth is None else nbytes / self.issue_bandwidth
        return self.issue_s + per_byte

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "collective": self.collective,
            "group_size": self.group_size,
            "level": self.level,
            "latency_s": self.latency_s,
            "bus_bandwidth": self.bus_bandwidth,
        }
        if self.issue_s or self.issue_bandwidth is not None:
            out["issue_s"] = self.issue_s
            out["issue_bandwidth"] = self.issue_bandwidth
        if self.pieces:
            out["pieces"] = [{"from_bytes": s, "bus_bandwidth": bw} for s, bw in self.pieces]
        return out


@dataclass(frozen=True, slots=True, kw_only=True)
class MachineProfile:
    """What communication costs on one machine: one ``LinkCost`` per collective, group size
    and level (docs/cost-model.md).

    ``ranks_per_node`` decides the level of a group: ``"node"`` when all its ranks share a
    node (ranks ``k * ranks_per_node`` to ``(k + 1) * ranks_per_node - 1``), else
    ``"network"``. ``source`` says where the figures come from (a calibration run, a
    datasheet). Optional: ``flops_per_s``, the compute rate a FLOP-based model profile
    assumes (``estimate_model_profile``); ``copy_bandwidth``, bytes per second of a copy in
    the device's memory (the executors copy gradients into buckets and gathered parameters
    out of them; None: copies cost nothing); ``overlap_slowdown``, how many times longer
    compute takes while a collective is in flight beside it (1: none, as with NCCL's own
    engines; about 2 where the collective's threads take the compute's cores, as gloo on a
    CPU with fewer cores than ranks); ``overlap_slowdowns``, the same per collective kind
    (``{"all_gather": 1000.0}``: gloo's all-gather makes no progress while its rank computes,
    so compute and the gather take their sum), a kind not listed taking ``overlap_slowdown``
    (while several collectives are in flight the largest of theirs counts); ``host_s``, per
    collective kind, the seconds of host work an executor spends on each collective it issues
    besides the issue itself (hooks, bookkeeping, the ranks' skew at the collective;
    ``gradsync calibrate`` measures it through the executors with a tiny model), and
    ``step_host_s``, per executor path (``"data_parallel"``: DDP's bucketed sync;
    ``"zero3"``: ``fully_shard``'s units), the seconds its per-step bookkeeping costs (DDP's
    used-map all-reduce, the agreement checks). A kind or path not listed costs nothing (as
    in a compiled JAX step).
    ``collective_scratch``, per collective kind, the bytes a collective allocates beside its
    buffers while in flight, per byte of its whole buffer (gloo's ``all_gather_into_tensor``
    allocates its output again and ``reduce_scatter_tensor`` clones its input: 1; NCCL and
    gloo's all-reduce and broadcast: 0). ``post_s``: the host time a pipeline runtime spends
    posting one message, ``{"send": s, "receive": s}`` (on the posting rank's clock; a send's
    data leaves when its post ends; ``simulate_pipeline``'s ``post`` and ``receive_post``),
    nothing where absent. ``pack_s``, per collective kind, the curve ``((nbytes, seconds),
    ...)`` (ascending sizes) of what a bucket of ``nbytes`` packed from several gradients
    costs the JAX executor beyond its collective: the ``concatenate``, the split and the
    buffers XLA:CPU allocates for them at every run (``gradsync_jax.cost.pack``; it replaces
    the bucket's copies at ``copy_bandwidth`` in ``predict(..., executor="jax")``); a kind not
    listed keeps the copies. Only ``"reduce_scatter"`` is read (a flat ``shard_optimizer``
    packs; ``synced`` all-reduces a bucket's gradients as they are, so an ``"all_reduce"``
    curve, which calibrate wrote before, costs nothing). ``cores``: how many ranks of a node
    compute at full speed at once (its cores over each rank's compute threads, where they are
    fewer than its ranks: CPU ranks); None, every rank computes on its own device. With it a
    pipeline's stages share the cores by processor sharing (``simulate_pipeline(cores=)``),
    and the model profile's times are taken as measured the way a data-parallel step runs,
    every rank of the node computing at once. The kind ``bucket_reduce_scatter`` (ZeRO-2's
    reduce-scatter of a bucket, which torch's executor runs its own way on gloo) reads
    ``reduce_scatter``'s link, slowdown, host time and scratch wherever the profile has none
    of its own.

    Example:
        >>> m = MachineProfile(name="toy", ranks_per_node=8, links=(
        ...     LinkCost(collective="all_reduce", group_size=None, latency_s=1e-5,
        ...              bus_bandwidth=1e11),))
        >>> round(m.time("all_reduce", 10**8, 4) * 1e3, 3)  # 10 us + 1.5 * 1e8 / 1e11 s
        1.51
    """

    name: str
    ranks_per_node: int
    links: tuple[LinkCost, ...]
    source: str = ""
    flops_per_s: float | None = None
    copy_bandwidth: float | None = None
    overlap_slowdown: float = 1.0
    overlap_slowdowns: Mapping[str, float] = field(default_factory=dict)
    host_s: Mapping[str, float] = field(default_factory=dict)
    step_host_s: Mapping[str, float] = field(default_factory=dict)
    collective_scratch: Mapping[str, float] = field(default_factory=dict)
    post_s: Mapping[str, float] = field(default_factory=dict)
    pack_s: Mapping[str, tuple[tuple[int, float], ...]] = field(default_factory=dict)
    cores: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive int, got {self.ranks_per_node!r}")
        if self.cores is not None and (
            isinstance(self.cores, bool) or not isinstance(self.cores, int) or self.cores < 1
        ):
            raise ValueError(f"cores must be a positive int or None, got {self.cores!r}")
        for name in ("flops_per_s", "copy_bandwidth"):
            if getattr(self, name) is not None:
                _finite(name, getattr(self, name), positive=True)
        if _finite("overlap_slowdown", self.overlap_slowdown, positive=True) < 1:
            raise ValueError(
                f"overlap_slowdown must be >= 1 (1: collectives do not slow compute), got "
                f"{self.overlap_slowdown!r}"
            )
        if not isinstance(self.overlap_slowdowns, Mapping):
            raise ValueError(
                f"overlap_slowdowns must be a mapping of numbers, got {self.overlap_slowdowns!r}"
            )
        for kind, slow in self.overlap_slowdowns.items():
            if kind not in COLLECTIVES:
                raise ValueError(
                    f"overlap_slowdowns has the unknown key {kind!r}; use {', '.join(COLLECTIVES)}"
                )
            if _finite(f"overlap_slowdowns[{kind!r}]", slow, positive=True) < 1:
                raise ValueError(
                    f"overlap_slowdowns[{kind!r}] must be >= 1 (1: the collective does not slow "
                    f"compute), got {slow!r}"
                )
        tables = (("host_s", COLLECTIVES), ("step_host_s", STEP_PATHS))
        for name, keys in (*tables, ("collective_scratch", COLLECTIVES), ("post_s", POSTS)):
            table = getattr(self, name)
            if not isinstance(table, Mapping):
                raise ValueError(f"{name} must be a mapping of numbers, got {table!r}")
            for key, seconds in table.items():
                if key not in keys:
                    raise ValueError(f"{name} has the unknown key {key!r}; use {', '.join(keys)}")
                _finite(f"{name}[{key!r}]", seconds, positive=False)
        _check_pack(self.pack_s)
        seen = set()
        for link in self.links:
            key = (link.collective, link.group_size, link.level)
            if key in seen:
                raise ValueError(
                    f"the profile lists {link.collective} over groups of {link.group_size} "
                    f"({link.level}) twice; keep one entry per collective, size and level"
                )
            seen.add(key)

    def level_of(self, ranks: Sequence[int]) -> str:
        """``"node"`` if every rank of the group is on one node, else ``"network"``."""
        return NODE if len({r // self.ranks_per_node for r in ranks}) <= 1 else NETWORK

    def link(self, collective: str, group_size: int, level: str = NODE) -> LinkCost:
        """The entry for ``collective`` over ``group_size`` ranks at ``level``: its own, or
        the level's entry for every size (``group_size`` null).

        Raises:
            ValueError: the profile has neither; the sentence says what to add.
        """
        _check_collective(collective)
        fallback = None
        for link in self.links:
            if link.collective == collective and link.level == level:
                if link.group_size == group_size:
                    return link
                if link.group_size is None:
                    fallback = link
        if fallback is not None:
            return fallback
        if collective in STANDS_IN and not any(k.collective == collective for k in self.links):
            return self.link(STANDS_IN[collective], group_size, level)
        sizes = sorted(
            {
                link.group_size
                for link in self.links
                if link.collective == collective and link.level == level and link.group_size
            }
        )
        where = "within a node" if level == NODE else "across nodes"
        raise ValueError(
            f"machine profile {self.name!r} has no {collective} cost for groups of {group_size} "
            f"ranks {where} (it has sizes {sizes or 'none'}); add one, or one with "
            '"group_size": null for every size (gradsync calibrate measures each group size '
            "of its world)"
        )

    def time(self, collective: str, nbytes: int, group_size: int, level: str = NODE) -> float:
        """Seconds of one ``collective`` of ``nbytes`` over ``group_size`` ranks; 0 for a
        group of one rank (no collective runs)."""
        if group_size == 1 and collective != P2P:
            return 0.0
        return self.link(collective, group_size, level).time(nbytes, group_size)

    def issue_time(self, collective: str, nbytes: int, group_size: int, level: str = NODE) -> float:
        """Seconds the issuing thread spends starting the collective, the executor's host work
        for it (``host_s``) included; 0 for a group of one (nothing is issued)."""
        if group_size == 1 and collective != P2P:
            return 0.0
        issue = self.link(collective, group_size, level).issue_time(nbytes)
        return issue + _entry(self.host_s, collective, 0.0)

    def slowdown(self, collective: str) -> float:
        """How many times longer compute takes while a ``collective`` is in flight beside it
        (``overlap_slowdowns``, else ``overlap_slowdown``)."""
        return float(_entry(self.overlap_slowdowns, collective, self.overlap_slowdown))

    def scratch_bytes(self, collective: str, nbytes: int) -> int:
        """Bytes a ``collective`` of ``nbytes`` (its whole buffer) allocates while in flight."""
        return round(_entry(self.collective_scratch, collective, 0.0) * nbytes)

    def post_time(self, which: str) -> float:
        """Seconds a pipeline runtime's host spends posting one message's ``which`` (``"send"``
        or ``"receive"``; ``post_s``, 0 if absent)."""
        if which not in POSTS:
            raise ValueError(f"unknown post {which!r}; use {', '.join(POSTS)}")
        return float(self.post_s.get(which, 0.0))

    def pack_time(self, collective: str, nbytes: int) -> float | None:
        """Seconds a bucket of ``nbytes`` packed from several gradients costs the JAX executor
        beyond its ``collective`` (``pack_s``: linear between its sizes, proportional below
        the first, the last range's slope above the last); None when the profile has no curve
        for that kind."""
        points = self.pack_s.get(collective)
        if not points:
            return None
        if nbytes <= 0:
            return 0.0
        first_n, first_s = points[0]
        if nbytes <= first_n or len(points) == 1:
            return first_s * nbytes / first_n
        (n0, s0), (n1, s1) = points[-2:]  # above the last size: the last range's slope
        for (n0, s0), (n1, s1) in itertools.pairwise(points):  # noqa: B007
            if nbytes <= n1:
                break
        return max(0.0, s0 + (s1 - s0) * (nbytes - n0) / (n1 - n0))

    def step_host_time(self, path: str) -> float:
        """Seconds of per-step host work of executor ``path`` (``step_host_s``; 0 if absent)."""
        if path not in STEP_PATHS:
            raise ValueError(f"unknown executor path {path!r}; use {', '.join(STEP_PATHS)}")
        return float(self.step_host_s.get(path, 0.0))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "kind": MACHINE_PROFILE_KIND,
            "version": MACHINE_PROFILE_VERSION,
            "name": self.name,
            "ranks_per_node": self.ranks_per_node,
            "source": self.source,
            "links": [link.to_json() for link in self.links],
        }
        for name in ("flops_per_s", "copy_bandwidth", "cores"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        out["overlap_slowdown"] = self.overlap_slowdown
        tables = ("overlap_slowdowns", "host_s", "step_host_s", "collective_scratch", "post_s")
        for name in tables:
            if getattr(self, name):
                out[name] = dict(sorted(getattr(self, name).items()))
        if self.pack_s:
            out["pack_s"] = {
                kind: [{"nbytes": n, "seconds": t} for n, t in points]
                for kind, points in sorted(self.pack_s.items())
            }
        return out

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> MachineProfile:
        """Read ``to_json()``'s output (or a hand-written profile) back, checked.

        A version-1 profile (before the host overheads) loads with none, a version-2 one
        (before the slowdown per collective kind) with ``overlap_slowdown`` for every kind, a
        version-3 one (before ``pieces`` and ``post_s``) with one line per link and no message
        posts, a version-4 one (before ``pack_s``) with no packing curves.

        Raises:
            ValueError: another kind or version, a missing or unknown key, a bad value.
        """
        _check_header(obj, MACHINE_PROFILE_KIND, MACHINE_PROFILE_VERSIONS)
        optional = ["kind", "version", "source", "flops_per_s", "copy_bandwidth"]
        optional += ["overlap_slowdown"]
        if obj["version"] >= 2:
            optional += ["host_s", "step_host_s", "collective_scratch"]
        if obj["version"] >= 3:
            optional += ["overlap_slowdowns"]
        if obj["version"] >= 4:
            optional += ["post_s"]
        if obj["version"] >= 5:
            optional += ["pack_s"]
        if obj["version"] >= 6:
            optional += ["cores"]
        _check_keys(
            obj,
            required=("name", "ranks_per_node", "links"),
            optional=optional,
            what=f"a version-{obj['version']} machine profile",
        )
        links = obj["links"]
        if not isinstance(links, list) or not links:
            raise ValueError("a machine profile needs a non-empty list of 'links'")
        parsed = []
        link_keys = ["group_size", "level", "issue_s", "issue_bandwidth"]
        if obj["version"] >= 4:
            link_keys += ["pieces"]
        for entry in links:
            _check_keys(
                entry,
                required=("collective", "latency_s", "bus_bandwidth"),
                optional=link_keys,
                what=f"a version-{obj['version']} machine profile link",
            )
            parsed.append(
                LinkCost(
                    collective=entry["collective"],
                    group_size=entry.get("group_size"),
                    level=entry.get("level", NODE),
                    latency_s=entry["latency_s"],
                    bus_bandwidth=entry["bus_bandwidth"],
                    issue_s=entry.get("issue_s", 0.0),
                    issue_bandwidth=entry.get("issue_bandwidth"),
                    pieces=_pieces(entry.get("pieces", [])),
                )
            )
        return cls(
            name=str(obj["name"]),
            ranks_per_node=obj["ranks_per_node"],
            links=tuple(parsed),
            source=str(obj.get("source", "")),
            flops_per_s=obj.get("flops_per_s"),
            copy_bandwidth=obj.get("copy_bandwidth"),
            overlap_slowdown=obj.get("overlap_slowdown", 1.0),
            overlap_slowdowns=_table(obj, "overlap_slowdowns"),
            host_s=_table(obj, "host_s"),
            step_host_s=_table(obj, "step_host_s"),
            collective_scratch=_table(obj, "collective_scratch"),
            post_s=_table(obj, "post_s"),
            pack_s=_pack(obj.get("pack_s", {})),
            cores=obj.get("cores"),
        )

    def copy_time(self, nbytes: int) -> float:
        """Seconds to copy ``nbytes`` within the device (0 without a copy bandwidth)."""
        return 0.0 if self.copy_bandwidth is None else nbytes / self.copy_bandwidth

    @classmethod
    def load(cls, path: str) -> MachineProfile:
        """Read a profile file (``gradsync calibrate``'s output or a hand-written one).

        Raises:
            ValueError: the file is unreadable or not a machine profile.
        """
        return cls.from_json(read_json(path, "machine profile"))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def fit_link(
    collective: str,
    group_size: int,
    samples: Sequence[tuple[int, float]],
    *,
    level: str = NODE,
    issue: Sequence[tuple[int, float]] = (),
    piecewise: bool = False,
) -> LinkCost:
    """The α-β line through measured ``(nbytes, seconds)`` samples, by least *relative* error.

    Minimizing ``sum(((α + β * S_i) / t_i - 1) ** 2)`` weighs a 4 KiB sample as much as a
    64 MiB one, so the line is good at every size a plan uses, not only the largest. ``α`` is
    kept at 0 or above (a negative intercept means the latency is below what the samples
    resolve). ``busbw = factor(n) / β``. ``issue``: the times the asynchronous call took to
    return, fitted the same way (a cost that does not grow with the size is kept constant).

    ``piecewise``: instead of one line, the curve through every measured size (``pieces``,
    one per range between two sizes; the last range's bandwidth goes on above the largest
    size, the first one's below the smallest). Where one line does not hold across sizes
    (XLA:CPU: 16 MiB takes 30 times 1 MiB) a line fitted to all sizes is off by 20 % or more
    at the large ones; the curve is what was measured at each size. A size whose median time
    is not above the smaller sizes' (noise at the latency floor) is left out, so the curve
    grows with the size.

    Raises:
        ValueError: fewer than two distinct sizes, a non-positive time, or samples whose time
            does not grow with the size (no bandwidth can be fitted).

    Example:
        >>> link = fit_link("all_reduce", 2, [(0, 1e-5), (10**6, 1e-5 + 1e-3)])
        >>> round(link.latency_s, 9), round(link.bus_bandwidth)
        (1e-05, 1000000000)
    """
    factor = bus_factor(collective, group_size)
    if group_size < 2:
        raise ValueError(f"a collective is measured over 2 ranks or more, got {group_size}")
    a, b = _fit_line(samples)
    pieces: tuple[tuple[int, float], ...] = ()
    if piecewise and b > 0:
        a, b, pieces = _fit_curve(samples)
        pieces = tuple((start, factor / slope) for start, slope in pieces)
    if b <= 0:
        raise ValueError(
            f"{collective} over {group_size} ranks: the time does not grow with the message "
            "size in these samples, so no bandwidth can be fitted; measure larger messages"
        )
    issue_s, issue_bandwidth = 0.0, None
    if issue:
        c, d = _fit_line(issue)
        if d > 0:
            issue_s, issue_bandwidth = c, 1 / d
        else:
            issue_s = sum(t for _, t in issue) / len(issue)
    return LinkCost(
        collective=collective,
        group_size=group_size,
        level=level,
        latency_s=a,
        bus_bandwidth=factor / b,
        issue_s=issue_s,
        issue_bandwidth=issue_bandwidth,
        pieces=pieces,
    )


def _fit_curve(
    samples: Sequence[tuple[int, float]],
) -> tuple[float, float, tuple[tuple[int, float], ...]]:
    """``(a, b, ((from_bytes, slope), ...))`` of the continuous piecewise-linear curve through
    each size's median time (``_fit_line``'s checks first): ``t = a + b * S`` up to the first
    piece, then each piece's seconds per byte. Sizes whose median is not above every smaller
    size's are left out; the first range's line goes through the origin where its intercept
    would be negative (a piece then starts at the smallest size)."""
    _fit_line(samples)
    by_size: dict[int, list[float]] = {}
    for nbytes, seconds in samples:
        by_size.setdefault(nbytes, []).append(seconds)
    points: list[tuple[int, float]] = []
    for nbytes in sorted(by_size):
        seconds = statistics.median(by_size[nbytes])
        if not points or seconds > points[-1][1]:
            points.append((nbytes, seconds))
    if len(points) < 2:
        return 0.0, 0.0, ()
    slopes = [(t1 - t0) / (s1 - s0) for (s0, t0), (s1, t1) in itertools.pairwise(points)]
    a = points[0][1] - slopes[0] * points[0][0]
    if a >= 0:
        pieces = zip(points[1:-1], slopes[1:], strict=True)
        return a, slopes[0], tuple((s, b) for (s, _), b in pieces)
    first = points[0][1] / points[0][0]  # a > 0 bytes: the intercept is negative only then
    return 0.0, first, tuple((s, b) for (s, _), b in zip(points[:-1], slopes, strict=True))


def _fit_line(samples: Sequence[tuple[int, float]]) -> tuple[float, float]:
    """``(a, b)`` of ``t = a + b * S`` by least relative error, ``a >= 0``."""
    if len({s for s, _ in samples}) < 2:
        raise ValueError("a fit needs samples at two message sizes at least")
    for nbytes, seconds in samples:
        if not (isinstance(seconds, int | float) and math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"a sample's time must be a positive number, got {seconds!r}")
        if nbytes < 0:
            raise ValueError(f"a sample's size must be >= 0 bytes, got {nbytes!r}")
    # Normal equations of min sum (a * u + b * v - 1)^2 with u = 1/t, v = S/t.
    uu = sum(1 / t**2 for _, t in samples)
    uv = sum(s / t**2 for s, t in samples)
    vv = sum(s * s / t**2 for s, t in samples)
    u1 = sum(1 / t for _, t in samples)
    v1 = sum(s / t for s, t in samples)
    det = uu * vv - uv * uv
    a = (u1 * vv - v1 * uv) / det if det else 0.0
    b = (uu * v1 - uv * u1) / det if det else 0.0
    if a < 0:  # latency below resolution: the best line through the origin
        a, b = 0.0, v1 / vv
    return a, b


def read_json(path: str, what: str, max_bytes: int = 64 << 20) -> Any:
    """The JSON value in file ``path``, at most ``max_bytes`` long.

    Raises:
        ValueError: one sentence naming the file and what is wrong with it.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise ValueError(f"cannot read the {what} {path!r}: {e.strerror}") from None
    if len(raw) > max_bytes:
        raise ValueError(f"the {what} {path!r} is larger than {max_bytes >> 20} MiB")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ValueError(f"the {what} {path!r} is not valid JSON: {e}") from None


def _pieces(entries: object) -> tuple[tuple[int, float], ...]:
    """A link's ``pieces`` from JSON: a list of ``{"from_bytes", "bus_bandwidth"}`` objects."""
    if not isinstance(entries, list):
        raise ValueError(
            f"a link's 'pieces' must be a list of objects, got {type(entries).__name__}"
        )
    out = []
    for entry in entries:
        _check_keys(
            entry, required=("from_bytes", "bus_bandwidth"), optional=(), what="a link's piece"
        )
        out.append((entry["from_bytes"], entry["bus_bandwidth"]))
    return tuple(out)


def _pack(obj: object) -> dict[str, tuple[tuple[int, float], ...]]:
    """``pack_s`` from JSON: ``{kind: [{"nbytes", "seconds"}, ...]}`` (checked by the
    profile)."""
    if not isinstance(obj, Mapping):
        raise ValueError(f"'pack_s' must be an object of lists, got {type(obj).__name__}")
    out = {}
    for kind, entries in obj.items():
        if not isinstance(entries, list):
            raise ValueError(f"pack_s[{kind!r}] must be a list of objects")
        points = []
        for entry in entries:
            _check_keys(entry, required=("nbytes", "seconds"), optional=(), what="a pack_s point")
            points.append((entry["nbytes"], entry["seconds"]))
        out[kind] = tuple(points)
    return out


def _check_pack(pack: object) -> None:
    """``pack_s``: per collective kind, points at ascending sizes above 0 with times >= 0."""
    if not isinstance(pack, Mapping):
        raise ValueError(f"pack_s must be a mapping of curves, got {pack!r}")
    for kind, points in pack.items():
        if kind not in COLLECTIVES:
            raise ValueError(f"pack_s has the unknown key {kind!r}; use {', '.join(COLLECTIVES)}")
        _check_sized(points, f"pack_s[{kind!r}]", "(nbytes, seconds)", positive=False)


def _check_sized(points: Sequence[Any], what: str, pair: str, *, positive: bool) -> None:
    """``points``: ``pair`` tuples (an int size, then a finite figure: above 0 if
    ``positive``, else at least 0) at increasing sizes above 0 bytes; ``what`` names them in
    the error."""
    start = 0
    for point in points:
        ok = isinstance(point, tuple) and len(point) == 2
        if not ok or isinstance(point[0], bool) or not isinstance(point[0], int):
            raise ValueError(f"{what} are {pair} pairs with an int size, got {point!r}")
        if point[0] <= start:
            raise ValueError(
                f"{what} must be at increasing sizes above 0 bytes, got "
                f"{[p[0] for p in points]}; list them in ascending order, once each"
            )
        start = point[0]
        figure = pair.strip("()").split(", ")[1]
        _finite(f"the {figure} at {point[0]} bytes in {what}", point[1], positive=positive)


def _table(obj: Mapping[str, Any], name: str) -> Any:
    """A copy of the profile's table ``name`` (``{}`` when absent; checked by the profile)."""
    table = obj.get(name, {})
    return dict(table) if isinstance(table, Mapping) else table


def _check_header(obj: object, kind: str, version: int | Sequence[int]) -> None:
    if not isinstance(obj, Mapping):
        raise ValueError(f"expected a JSON object for a {kind}, got {type(obj).__name__}")
    if obj.get("kind") != kind:
        raise ValueError(f"expected kind {kind!r}, got {obj.get('kind')!r}")
    versions = (version,) if isinstance(version, int) else tuple(version)
    found = obj.get("version")
    if isinstance(found, bool) or found not in versions:
        readable = " or ".join(str(v) for v in versions)
        raise ValueError(
            f"{kind} has version {found!r}; this gradsync reads version {readable}: "
            "write it again with this version"
        )


def _check_keys(
    obj: object, *, required: Sequence[str], optional: Sequence[str], what: str
) -> None:
    if not isinstance(obj, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {type(obj).__name__}")
    missing = [key for key in required if key not in obj]
    if missing:
        raise ValueError(f"{what} lacks the key {missing[0]!r}")
    unknown = sorted(set(obj) - set(required) - set(optional))
    if unknown:
        known = ", ".join(repr(k) for k in (*required, *optional))
        raise ValueError(f"{what} has the unknown key {unknown[0]!r}; it takes {known}")
