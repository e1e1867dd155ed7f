"""What a bucket of several gradients costs the JAX executor beyond its collective.

A flat ``shard_optimizer`` (ZeRO-2) packs a bucket's gradients into one flat array (a
``concatenate``), reduce-scatters it, steps its shard, all-gathers it and splits it back; a
bucket of one gradient is that gradient itself (a bitcast). (``synced(plan=...)`` all-reduces
a bucket as a ``psum`` of its gradients and packs nothing.) The packed bucket costs more than
its copies: XLA:CPU allocates a program's temporary buffers (the packed gradients and the
gathered result) with ``malloc`` at every run and frees them at its end, and glibc hands a
large block back with fresh pages often enough (trimmed or unmapped in between) that a step
pays the kernel's page faults on them: a data-parallel step of 8 MiB of gradients in one
packed bucket took about 10,000 minor faults a step, the same step with a bucket per gradient
none.

``measure_pack`` times that on the executor's own path: ``data_parallel_step`` with
``shard_optimizer(optax.adam(...), partition="flat")`` on a model of eight parameter arrays
and a loss whose gradient is a fill, once with the eight in one bucket and once with a bucket
each, run in turns with the state fed back as a training loop does; the median of the rounds'
differences is the packed bucket's cost at that size (``MachineProfile.pack_s
["reduce_scatter"]``). Never the user's model or a benchmark's step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax

from gradsync_core import Topology
from gradsync_jax._mesh import mesh_from_topology
from gradsync_jax.data_parallel import data_parallel_step
from gradsync_jax.zero import shard_optimizer

LEAVES = 8  # parameter arrays packed into the bucket
WARMUP = 2


def _step(devices: Sequence[Any], nbytes: int, packed: bool) -> tuple[Any, list[Any]]:
    """The executor's step over ``devices`` with ``LEAVES`` arrays of ``nbytes`` in all, in
    one bucket or one bucket each; ``(step, [params, opt_state, batch])``."""

    numel = max(1, nbytes // 4 // LEAVES)
    names = [f"p{i}" for i in range(LEAVES)]
    mesh = mesh_from_topology(Topology.create(len(devices)), devices=list(devices))
    params = {name: jnp.full((numel,), 0.5, jnp.float32) for name in names}

    def loss_fn(p: Any, x: jax.Array) -> jax.Array:
        # each gradient is a fill (the batch's mean): the step is the sync and the update
        return sum(jnp.sum(p[name]) for name in names) * jnp.mean(x)

    cap = numel * 4 * (LEAVES if packed else 1) / (1 << 20)
    tx = shard_optimizer(optax.adam(1e-3), mesh, partition="flat", bucket_cap_mb=cap)
    step = data_parallel_step(loss_fn, tx, mesh)
    batch = jnp.ones((len(devices),), jnp.float32)
    return step, [params, tx.init(params), batch]


def measure_pack(
    devices: Sequence[Any] | None = None, *, sizes: Sequence[int], repeats: int
) -> list[tuple[int, float]]:
    """``[(nbytes, seconds), ...]``: what a bucket of ``nbytes`` packed from several gradients
    costs a flat ``shard_optimizer``'s data-parallel step over ``devices`` (default all local
    devices) beyond the same gradients in a bucket each, the two steps run in turns
    ``repeats`` times (at least 5)."""
    devices = list(jax.local_devices() if devices is None else devices)
    out = []
    for nbytes in sizes:
        runs = [_step(devices, nbytes, packed) for packed in (False, True)]
        times: list[list[float]] = [[], []]
        for r in range(WARMUP + max(repeats, 5)):
            for i, (step, state) in enumerate(runs):
                start = time.perf_counter()
                params, opt_state, loss = step(*state)
                jax.block_until_ready((params, opt_state, loss))
                if r >= WARMUP:
                    times[i].append(time.perf_counter() - start)
                state[:2] = [params, opt_state]
        # the median of each round's difference: the two steps of a round see the same load
        extra = statistics.median(b - a for a, b in zip(*times, strict=True))
        out.append((LEAVES * max(1, nbytes // 4 // LEAVES) * 4, max(0.0, extra)))
        del runs
    return out
