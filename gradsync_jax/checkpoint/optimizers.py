"""Optax optimizers and state as gradsync_core's canonical names (docs/checkpoints.md).

A checkpoint names state by canonical keys (torch's: ``exp_avg``) and an optimizer that
crosses frameworks by a canonical name (``adam``); gradsync_core spells no Optax internals.
This module is the one place Optax's side is spelled: which state fields are which canonical
keys, and which chains of Optax state types compute which canonical optimizer. The state types
are those of ``inner.init`` for a tree without parameters (``ModelSpace.state_types``), so
``optax.adamw`` is told from ``optax.adam`` by its extra ``EmptyState`` (optax 0.2: a
``add_decayed_weights`` link). If Optax changes a chain, only this table changes.
"""

from __future__ import annotations

# Optax state field -> canonical state key.
OPTAX_TO_CANONICAL_KEY = {
    "mu": "exp_avg",
    "nu": "exp_avg_sq",
    "count": "step",
    "trace": "momentum_buffer",
}

# The state type of a transformation that keeps no state (clipping, scaling, weight decay).
STATELESS = "EmptyState"

# Optax state types of a chain -> the canonical optimizer it computes.
CANONICAL_OPTIMIZERS: dict[tuple[str, ...], str] = {
    ("ScaleByAdamState", "EmptyState"): "adam",
    ("ScaleByAdamState", "EmptyState", "EmptyState"): "adamw",
    ("TraceState", "EmptyState"): "sgd_momentum",
    ("EmptyState", "EmptyState"): "sgd",
}


def canonical_key(optax_key: str) -> str:
    """The checkpoint key of an Optax state field (``mu`` -> ``exp_avg``; others as they are)."""
    return OPTAX_TO_CANONICAL_KEY.get(optax_key, optax_key)


def optimizer_name(state_types: tuple[str, ...]) -> str:
    """How a checkpoint names the optimizer whose state has ``state_types``: its canonical
    name when it has one (``"adam"``), else ``"optax:<types>"``, which only the same chain of
    Optax transformations matches on load (a Lion state never loads into Adam).

    Stateless transformations chained before the optimizer (``chain(clip(1.0), adamw(...))``,
    ``clip_by_global_norm``) keep no state, so they neither add nor move any
    of it: the chain is named by what follows them, and loads a torch ``AdamW`` checkpoint
    whose clipping ran outside the optimizer (``clip_grad_norm_``). Only a leading run of
    them is skipped: Optax's own chains end in stateless links (``adamw``'s decay and
    learning-rate scale), whose count tells ``adam`` from ``adamw``."""
    for skip in range(len(state_types)):
        if skip and state_types[skip - 1] != STATELESS:
            break
        canonical = CANONICAL_OPTIMIZERS.get(state_types[skip:])
        if canonical is not None:
            return canonical
    return "optax:" + ",".join(state_types)
