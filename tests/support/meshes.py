"""The JAX meshes the tests run on: the first ``n`` of the 8 CPU devices (tests/conftest.py)."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from gradsync_core import Topology
from gradsync_jax import mesh_from_topology


def mesh_of(n: int) -> Mesh:
    """``Topology.create(n)``'s mesh (every axis named, ``dp`` of size ``n``, ``Explicit``
    axes) over devices ``0 .. n-1``: what ``shard_optimizer`` and ``data_parallel_step`` take."""
    return mesh_from_topology(Topology.create(n), sorted(jax.devices(), key=lambda d: d.id)[:n])


def dp_mesh(n: int) -> Mesh:
    """A one-axis ``("dp",)`` mesh over devices ``0 .. n-1``, built as docs/jax-zero3.md builds
    it (``jax.sharding.Mesh``, default axis types): what the ZeRO-3 tests give ``zero3_step``."""
    return Mesh(np.array(jax.devices()[:n]), ("dp",))
