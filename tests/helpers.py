"""Assertions and data slicing shared by the test suites (one copy, not one per file)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from gradsync_core import Topology, split_shapes


def assert_tree_close(
    actual: Any,
    expected: Any,
    *,
    rtol: float = 1e-5,
    atol_rel: float | None = None,
    check_dtype: bool = False,
    what: str = "",
) -> None:
    """Leaf by leaf ``assert_allclose``; the absolute tolerance is relative to the largest
    expected magnitude of each leaf: ``atol_rel * max|expected|`` (``atol_rel`` defaults to
    ``rtol``). Both trees must have the same number of leaves and the same shapes."""
    actual_leaves = jax.tree_util.tree_leaves_with_path(actual)
    expected_leaves = jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves), what
    scale_of_atol = rtol if atol_rel is None else atol_rel
    for (path, a), e in zip(actual_leaves, expected_leaves, strict=True):
        a, e = np.asarray(a), np.asarray(e)
        what = f"{what} {jax.tree_util.keystr(path)}".strip()
        assert a.shape == e.shape, f"{what}: shape {a.shape} != {e.shape}"
        if check_dtype:
            assert a.dtype == e.dtype, f"{what}: dtype {a.dtype} != {e.dtype}"
        scale = float(np.abs(e).max()) if e.size else 0.0
        atol = scale_of_atol * max(scale, 1e-30)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol, err_msg=what)


def assert_tree_equal(actual: Any, expected: Any, *, same_structure: bool = False) -> None:
    """Leaf by leaf bitwise equality (and with ``same_structure`` equal tree structures)."""
    if same_structure:
        assert jax.tree.structure(actual) == jax.tree.structure(expected)
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


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
