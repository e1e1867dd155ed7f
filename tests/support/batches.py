"""A rank's slice of a global batch under a ``Topology``; for NumPy, JAX and torch arrays alike
(it imports no framework, so a torch rank imports it without JAX)."""

from __future__ import annotations

from typing import Any

from gradsync_core import Topology, split_shapes


def local_tokens(topo: Topology, rank: int, full: Any, sequence_parallel: bool) -> Any:
    """Rank ``rank``'s slice of a ``(batch, seq, ...)`` array (NumPy, JAX or torch): its dp
    rows, its cp chunk of the sequence and, under sequence parallelism, its tp chunk of that."""
    coords = topo.coordinates(rank)

    def chunk(size: int, parts: int, index: int) -> slice:
        sizes = split_shapes(size, parts)
        start = sum(sizes[:index])
        return slice(start, start + sizes[index])

    rows = full[chunk(full.shape[0], topo.dp, coords["dp"])]
    seq = rows[:, chunk(rows.shape[1], topo.cp, coords["cp"])]
    if sequence_parallel:
        seq = seq[:, chunk(seq.shape[1], topo.tp, coords["tp"])]
    return seq
