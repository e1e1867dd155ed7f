"""Matrix owners for ``shard_optimizer``: Muon's matrices planned by Newton-Schulz work.

``optax.contrib.muon`` orthogonalizes each matrix's momentum over the whole matrix, so it
runs exactly only where a device holds whole matrices: the greedy partition, which the flat
one's refusal names and ``"auto"`` picks. Greedy's owners balance bytes, as torch's
``ZeroRedundancyOptimizer``; for the matrices Muon steps (its ``MuonState.mu`` leaves that are
not masked) the owners come instead from ``gradsync_core.plan_matrix_owners``, balanced by
Newton-Schulz work over the torch names and layouts, so torch's ``MatrixOptimizer`` and JAX
plan the same owners for the same model (docs/matrix-optimizers.md). The other parameters
(AdamW's, in Muon's partition) keep greedy's byte-balanced owners.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax
from optax.contrib import MuonState
from optax.transforms import _masking

from gradsync_core import MatrixOwnerPlan, ParamSpec, plan_matrix_owners
from gradsync_jax._naming import _torch_shape, torch_name
from gradsync_jax.zero.model_space import ModelSpace

_is_muon = lambda x: isinstance(x, MuonState)  # noqa: E731


def keeps_muon_state(inner: optax.GradientTransformation, params: Any) -> bool:
    """Whether ``inner`` (initialized on ``params``) keeps a ``MuonState``: a Muon, even
    where ``params`` hold none of its matrices (a sample tree)."""
    try:
        state = jax.eval_shape(inner.init, params)
    except Exception:  # an init that needs the real tree
        return False
    return any(_is_muon(node) for node in jax.tree.leaves(state, is_leaf=_is_muon))


def muon_matrices(inner: optax.GradientTransformation, space: ModelSpace, params: Any) -> list[int]:
    """The parameter leaves (tree order) whose momentum a ``MuonState`` keeps: the matrices
    Muon orthogonalizes (none for another optimizer)."""
    try:
        state = jax.eval_shape(inner.init, params)
    except Exception:  # an init that needs the real tree: no matrix plan
        return []
    found: set[int] = set()
    for node in jax.tree.leaves(state, is_leaf=_is_muon):
        if not _is_muon(node):
            continue
        try:
            mu = space.param_treedef.flatten_up_to(node.mu)
        except (ValueError, TypeError):  # a mu of another structure (a sub-tree): no plan
            return []
        found.update(i for i, leaf in enumerate(mu) if not isinstance(leaf, _masking.MaskedNode))
    return sorted(found)


def torch_matrix_specs(
    space: ModelSpace, indices: list[int], modules: Mapping[str, str] | None = None
) -> list[ParamSpec]:
    """The specs of the matrices ``indices`` in torch's names and layouts (a 2-D ``kernel``
    ``(in, out)`` is torch's ``(out, in)``; the cost does not depend on it, the plan's JSON
    does)."""
    return [
        ParamSpec(
            name=torch_name(space.specs[i].name, modules=modules),
            shape=_torch_shape(space.specs[i].name, space.specs[i].shape),
            dtype=space.specs[i].dtype,
        )
        for i in indices
    ]


def matrix_owner_plan(
    inner: optax.GradientTransformation,
    space: ModelSpace,
    params: Any,
    n: int,
    *,
    modules: Mapping[str, str] | None = None,
) -> tuple[MatrixOwnerPlan, dict[int, int]] | None:
    """The matrix-owner plan of Muon's matrices over ``n`` devices and each matrix leaf's
    owner (by tree index), or ``None`` when ``inner`` keeps no ``MuonState``."""
    indices = muon_matrices(inner, space, params)
    if not indices:
        return None
    specs = torch_matrix_specs(space, indices, modules)
    plan = plan_matrix_owners(specs, world_size=n, cost="newton_schulz")
    owners = {i: plan.owner(spec.name) for i, spec in zip(indices, specs, strict=True)}
    return plan, owners


# Why partition="flat" refuses a Muon (the middle of ``flat.not_elementwise``'s sentence).
MUON_REASON = (
    "orthogonalizes each matrix's momentum over the whole matrix (Muon's Newton-Schulz "
    "iterations: greedy steps each matrix whole on the owner gradsync_core.plan_matrix_owners "
    "plans by its Newton-Schulz work, docs/matrix-optimizers.md)"
)
