"""Comparisons shared by the test suites (one copy, not one per file).

Imports NumPy only at the top: the tree comparisons import JAX and the tensor one imports torch
when called, so a torch rank (tests/support/harness.py) imports this module without JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np


def rel_err(actual: Any, expected: Any) -> float:
    """``max|actual - expected| / max|expected|`` in float64; absolute where ``expected`` is all
    zero (a frozen bias, an untouched moment)."""
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    scale = float(np.max(np.abs(e))) if e.size else 0.0
    return float(np.max(np.abs(a - e), initial=0.0)) / (scale if scale > 0 else 1.0)


def assert_close(actual: Any, expected: Any, rtol: float, what: str) -> float:
    """Leaf by leaf ``rel_err(actual, expected) <= rtol`` (the error relative to the largest
    expected entry of each tensor: the reduction-order floor of
    tests/parity/test_cross_checkpoint.py is stated that way). Both pytrees (a dict of arrays
    is one) must have the same keys and shapes.

    Returns:
        The largest relative error seen, for a test that reports its margin.
    """
    import jax

    actual_leaves = jax.tree_util.tree_leaves_with_path(actual)
    expected_leaves = jax.tree_util.tree_leaves_with_path(expected)
    actual_keys = [jax.tree_util.keystr(path) for path, _ in actual_leaves]
    assert actual_keys == [jax.tree_util.keystr(path) for path, _ in expected_leaves], what
    worst = 0.0
    for key, (_, a), (_, e) in zip(actual_keys, actual_leaves, expected_leaves, strict=True):
        assert np.shape(a) == np.shape(e), f"{what} {key}: shape {np.shape(a)} != {np.shape(e)}"
        error = rel_err(a, e)
        assert error <= rtol, f"{what} {key}: relative error {error:.2e} > {rtol}"
        worst = max(worst, error)
    return worst


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
    import jax

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
    import jax

    if same_structure:
        assert jax.tree.structure(actual) == jax.tree.structure(expected)
    actual_leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(actual_leaves) == len(expected_leaves)
    for a, e in zip(actual_leaves, expected_leaves, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))


def assert_tensors_close(
    actual: Sequence[Any] | Mapping[str, Any],
    expected: Sequence[Any] | Mapping[str, Any],
    what: str,
    *,
    rtol: float,
    atol: float,
) -> None:
    """``torch.testing.assert_close`` on each tensor: two lists pairwise (equal lengths), or
    each name of the ``actual`` dict against the same name of ``expected``."""
    import torch

    if isinstance(actual, Mapping):
        pairs = [(name, a, expected[name]) for name, a in actual.items()]
    else:
        pairs = [(str(i), a, e) for i, (a, e) in enumerate(zip(actual, expected, strict=True))]
    for name, a, e in pairs:
        torch.testing.assert_close(
            a, e, rtol=rtol, atol=atol, msg=lambda m, n=name: f"{what} {n}: {m}"
        )


def assert_tensors_equal(actual: Mapping[str, Any], expected: Mapping[str, Any]) -> None:
    """The same names, and under each bitwise the same tensor (``torch.equal``, same dtype and
    shape)."""
    import torch

    assert actual.keys() == expected.keys(), sorted(set(actual) ^ set(expected))
    for key in actual:
        a, e = actual[key], expected[key]
        assert a.dtype == e.dtype and a.shape == e.shape, key
        assert torch.equal(a, e), (key, (a - e).abs().max())
