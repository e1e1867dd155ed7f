"""``gradsync calibrate --framework jax``: time each collective over the local devices.

For every group size that divides the number of devices, the devices form a mesh
``("rest", "group")`` and one ``jax.shard_map`` program runs a collective over ``"group"``
``inner`` times in a row (a loop-carried dependency keeps XLA from merging them), so the time
per collective is what it costs inside a compiled step, without the dispatch of a call. The
collectives are the ones the JAX executor's programs contain: ``psum`` (all-reduce),
``all_gather``, ``psum_scatter`` (reduce-scatter), ``ppermute`` between pairs (point-to-point)
and, as JAX has no broadcast, a ``psum`` in which only the group's first device contributes
(how a broadcast is written in JAX). ``fit_link`` of ``gradsync_core`` turns each into latency
and bus bandwidth, piecewise: one line across sizes does not hold on XLA:CPU (an all-reduce
of 16 MiB over 8 devices takes 29 times one of 1 MiB), so each range between two measured
sizes has its own bandwidth (``LinkCost.pieces``). XLA runs a CPU program's collectives in
line with its compute, so the profile's ``overlap_slowdown`` is 1 and its issue costs 0; the
copy bandwidth is measured, and what a bucket packed from several gradients costs the
executor's own data-parallel step beyond its collective (``pack_s["reduce_scatter"]``,
``gradsync_jax.cost.pack``: a flat ``shard_optimizer``'s ``concatenate``, its split and the
buffers XLA:CPU allocates for them at every run; ``synced``'s all-reduce packs nothing).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gradsync_core.plan import COLLECTIVES, MachineProfile, fit_link
from gradsync_jax.cost.pack import measure_pack

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = (16 * KIB, 256 * KIB, 1 * MIB, 4 * MIB, 16 * MIB)
DEFAULT_REPEATS = 5
# pack_s's sizes: XLA:CPU's buffers change behaviour between 8 and 16 MiB (twice the bucket
# beyond glibc's largest mmap threshold, 32 MiB: fresh pages at every run), so every power of 2
PACK_SIZES = (1 * MIB, 2 * MIB, 4 * MIB, 8 * MIB, 16 * MIB)
PACK_REPEATS = 9
# The collectives the JAX executor's programs contain: every kind of the machine profile but
# ``bucket_reduce_scatter`` (a ZeRO-2 bucket's is ``psum_scatter``, the plain reduce-scatter,
# whose link the profile's reader then uses for it).
XLA_COLLECTIVES = tuple(c for c in COLLECTIVES if c != "bucket_reduce_scatter")
INNER = 8  # collectives per program: the time of one is the program's over this
Samples = dict[tuple[str, int], list[tuple[int, float]]]


def _body(collective: str, group: int, numel: int) -> tuple[Callable[[jax.Array], jax.Array], int]:
    """The per-device loop body and the length of its carried array (``numel`` is the whole
    buffer of one collective, ``nbytes / 4``)."""
    chunk = numel // group
    scale = 1.0 / group

    if collective == "all_reduce":
        return lambda x: jax.lax.psum(x, "group") * scale, numel
    if collective == "all_gather":

        def gather(x: jax.Array) -> jax.Array:
            y = jax.lax.all_gather(x, "group", tiled=True)
            peer = (jax.lax.axis_index("group") + 1) % group
            return jax.lax.dynamic_slice(y, (peer * chunk,), (chunk,))

        return gather, chunk
    if collective == "reduce_scatter":

        def scatter(x: jax.Array) -> jax.Array:
            part = jax.lax.psum_scatter(x, "group", tiled=True) * scale
            return jax.lax.dynamic_update_slice(x, part, (0,))

        return scatter, numel
    if collective == "broadcast":

        def broadcast(x: jax.Array) -> jax.Array:
            first = jax.lax.axis_index("group") == 0
            return jax.lax.psum(jnp.where(first, x, 0.0), "group")

        return broadcast, numel
    pairs = [(i, i ^ 1) for i in range(group)]
    return lambda x: jax.lax.ppermute(x, "group", pairs), numel


def _timed(fn: Callable[[jax.Array], jax.Array], x: jax.Array, repeats: int) -> float:
    jax.block_until_ready(fn(x))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(x))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(
    devices: Sequence[Any] | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    collectives: Sequence[str] = XLA_COLLECTIVES,
) -> Samples:
    """``{(collective, group size): [(nbytes, seconds), ...]}`` over ``devices`` (default all
    local devices), every group of a size running at once."""
    devices = list(jax.local_devices() if devices is None else devices)
    n = len(devices)
    out: Samples = {}
    for group in [g for g in range(2, n + 1) if n % g == 0]:
        mesh = Mesh(np.array(devices).reshape(n // group, group), ("rest", "group"))
        for collective in collectives:
            if collective == "p2p" and group % 2:
                continue
            for nbytes in sizes:
                numel = max(group, nbytes // 4 // group * group)
                body, length = _body(collective, group, numel)

                def program(
                    x: jax.Array, body: Callable[[jax.Array], jax.Array] = body
                ) -> jax.Array:
                    return jax.lax.fori_loop(0, INNER, lambda _, y: body(y), x)

                fn = jax.jit(
                    jax.shard_map(
                        program,
                        mesh=mesh,
                        in_specs=P(("rest", "group")),
                        out_specs=P(("rest", "group")),
                        check_vma=False,  # psum's result is the same on the group
                    )
                )
                x = jax.device_put(
                    jnp.ones(length * n, jnp.float32),
                    jax.sharding.NamedSharding(mesh, P(("rest", "group"))),
                )
                seconds = _timed(fn, x, repeats) / INNER
                out.setdefault((collective, group), []).append((numel * 4, seconds))
    return out


def copy_bandwidth(devices: Sequence[Any] | None = None, nbytes: int = 16 * MIB) -> float:
    """Bytes per second of a copy on every device at once."""
    devices = list(jax.local_devices() if devices is None else devices)
    mesh = Mesh(np.array(devices), ("d",))
    numel = nbytes // 4

    def program(x: jax.Array) -> jax.Array:
        # one elementwise pass reads and writes every byte once, as a copy does
        return jax.lax.fori_loop(0, INNER, lambda _, y: y + 1.0, x)

    fn = jax.jit(jax.shard_map(program, mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    x = jax.device_put(
        jnp.ones(numel * len(devices), jnp.float32), jax.sharding.NamedSharding(mesh, P("d"))
    )
    return nbytes / (_timed(fn, x, DEFAULT_REPEATS) / INNER)


def calibrate(
    devices: Sequence[Any] | None = None,
    *,
    sizes: Sequence[int] = DEFAULT_SIZES,
    repeats: int = DEFAULT_REPEATS,
    name: str | None = None,
    pack_sizes: Sequence[int] = PACK_SIZES,
) -> MachineProfile:
    """The machine profile of ``devices`` (default all local devices); ``pack_sizes``: the
    bucket sizes ``pack_s`` is measured at (none: no curve).

    Raises:
        ValueError: fewer than 2 devices, or samples no line fits.

    Example:
        >>> profile = calibrate(sizes=(65536, 1 << 20), repeats=1)  # doctest: +SKIP
    """
    devices = list(jax.local_devices() if devices is None else devices)
    if len(devices) < 2:
        raise ValueError(
            "calibrate needs 2 devices or more; on a CPU set "
            "XLA_FLAGS=--xla_force_host_platform_device_count=8 before importing JAX"
        )
    start = time.perf_counter()
    samples = measure(devices, sizes=sizes, repeats=repeats)
    copy = copy_bandwidth(devices)
    pack = (
        {"reduce_scatter": _growing(measure_pack(devices, sizes=pack_sizes, repeats=PACK_REPEATS))}
        if pack_sizes
        else {}
    )
    # XLA:CPU's time per byte grows with the size (caches): the curve through every size
    links = tuple(
        fit_link(c, g, points, piecewise=True) for (c, g), points in sorted(samples.items())
    )
    when = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    return MachineProfile(
        name=name or f"{platform.node()} jax {devices[0].platform}",
        ranks_per_node=len(devices),
        links=links,
        source=f"gradsync calibrate: jax {jax.__version__} {devices[0].platform}, {len(devices)} "
        f"devices on {platform.node()}, {when}, {time.perf_counter() - start:.1f} s; broadcast "
        "as a psum from the group's first device",
        copy_bandwidth=copy,
        pack_s=pack,
    )


def _growing(points: Sequence[tuple[int, float]]) -> tuple[tuple[int, float], ...]:
    """The curve through ``points`` that never falls: a size measured below a smaller one
    (noise, or glibc reusing the pages) takes the smaller one's time."""
    out: list[tuple[int, float]] = []
    for nbytes, seconds in sorted(points):
        out.append((nbytes, max(seconds, out[-1][1] if out else 0.0)))
    return tuple(out)


def calibrate_command(
    *, world_size: int | None, sizes: Sequence[int], repeats: int, name: str | None
) -> MachineProfile:
    """The ``gradsync.calibrate`` entry point: the first ``world_size`` local devices (default
    all)."""
    devices = jax.local_devices()
    if world_size is not None:
        if world_size > len(devices):
            raise ValueError(
                f"--world-size {world_size} but JAX sees {len(devices)} local devices; on a CPU "
                "set XLA_FLAGS=--xla_force_host_platform_device_count=N"
            )
        devices = devices[:world_size]
    return calibrate(devices, sizes=sizes, repeats=repeats, name=name)
