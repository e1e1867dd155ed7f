"""Where executors' optimizer state meets: canonical optimizer names and their state keys.

A version-2 checkpoint names state by the canonical keys (torch's: ``exp_avg``,
``exp_avg_sq``, ``momentum_buffer``, ``step``; docs/design.md §9), and names an optimizer that
crosses frameworks by a canonical name (``adam``, ``adamw``, ``sgd``, ``sgd_momentum``). Each
executor maps its framework's objects onto these names: ``gradsync_jax.checkpoint.optimizers``
maps Optax's state types and fields, and torch's classes are listed in ``COUNTERPARTS``.
The core spells no framework's internals, with one exception kept for old files
(``LEGACY_OPTIMIZER_NAMES``). A checkpoint crosses frameworks only between an optimizer and
its listed counterpart, so an RMSprop state is never read as Adam's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradsync_core.plan._specs import ParamSpec

# Canonical optimizer -> the per-parameter state keys every framework's version keeps.
OPTIMIZER_STATE_KEYS: dict[str, tuple[str, ...]] = {
    "adam": ("exp_avg", "exp_avg_sq", "step"),
    "adamw": ("exp_avg", "exp_avg_sq", "step"),
    "sgd_momentum": ("momentum_buffer",),
    "sgd": (),  # without momentum: no state on either side
}

# torch optimizer (as a torch manifest names it) -> the canonical optimizers whose arithmetic
# it computes; another framework's optimizer with one of these canonical names is its
# counterpart.
COUNTERPARTS: dict[str, tuple[str, ...]] = {
    "torch.optim.Adam": ("adam",),
    "torch.optim.AdamW": ("adamw",),
    "torch.optim.SGD": ("sgd_momentum", "sgd"),
}

# Version-2 manifests written by gradsync_jax before canonical names existed name the
# optimizer by its Optax state types. Read only, so those checkpoints still load; nothing
# writes these names any more, and a change in Optax never needs a change here.
LEGACY_OPTIMIZER_NAMES: dict[str, str] = {
    "optax:ScaleByAdamState,EmptyState": "adam",
    "optax:ScaleByAdamState,EmptyState,EmptyState": "adamw",
    "optax:TraceState,EmptyState": "sgd_momentum",
    "optax:EmptyState,EmptyState": "sgd",
}


def canonical_optimizer(name: str) -> str | None:
    """``"adam"`` for ``"adam"`` (or an old manifest's spelling of it); ``None`` for an
    optimizer that crosses no framework."""
    if name in OPTIMIZER_STATE_KEYS:
        return name
    return LEGACY_OPTIMIZER_NAMES.get(name)


def counterpart_keys(torch_optimizer: str, other: str) -> tuple[str, ...] | None:
    """The canonical per-parameter keys a torch optimizer and its counterpart ``other`` (a
    canonical name) keep, or ``None`` if they are not a pair."""
    canonical = canonical_optimizer(other)
    if canonical is None or canonical not in COUNTERPARTS.get(torch_optimizer, ()):
        return None
    return OPTIMIZER_STATE_KEYS[canonical]


def _same_optimizer(saved: str, mine: str) -> bool:
    return saved == mine or canonical_optimizer(saved) == canonical_optimizer(mine) is not None


def check_optimizer(
    saved_framework: str, saved_optimizer: str, framework: str, optimizer: str
) -> None:
    """Refuse a checkpoint of an optimizer that is neither this one nor its counterpart.

    Raises:
        ValueError: naming both optimizers.
    """
    if saved_framework == framework:
        if not _same_optimizer(saved_optimizer, optimizer):
            raise ValueError(
                f"checkpoint was written by optimizer {saved_optimizer!r}, this one is "
                f"{optimizer!r}; load it with the same optimizer class"
            )
        return
    torch_name, other = (
        (saved_optimizer, optimizer) if saved_framework == "torch" else (optimizer, saved_optimizer)
    )
    if counterpart_keys(torch_name, other) is None:
        known = ", ".join(f"{t} <-> {' / '.join(o)}" for t, o in COUNTERPARTS.items())
        raise ValueError(
            f"checkpoint optimizer {saved_optimizer!r} ({saved_framework}) has no counterpart "
            f"{optimizer!r} ({framework}); the pairs that cross frameworks are: {known}"
        )


def check_state_keys(
    saved_optimizer: str,
    optimizer: str,
    name: str,
    saved: Sequence[str],
    needed: Sequence[str],
) -> None:
    """Refuse a parameter whose saved canonical state keys are not those ``optimizer`` needs.

    Raises:
        ValueError: naming both optimizers, the parameter and the first missing key.
    """
    if sorted(saved) == sorted(needed):
        return
    missing = sorted(set(needed) - set(saved))
    unknown = sorted(set(saved) - set(needed))
    what = f"lacks {missing[0]!r}" if missing else f"has {unknown[0]!r}, which it does not keep"
    raise ValueError(
        f"the state of {name!r} saved by {saved_optimizer!r} holds {sorted(saved)}, but "
        f"{optimizer!r} keeps {sorted(needed)}: it {what}; load it into the optimizer that "
        "wrote it or its counterpart"
    )


def check_compatible(
    manifest: Any,
    params: Sequence[ParamSpec],
    *,
    optimizer: str,
    framework: str | None = None,
) -> None:
    """Refuse a checkpoint of another model or optimizer, naming the first difference.

    The world size and the framework may differ (that is resharding, or crossing over through
    a counterpart optimizer); names, shapes, dtypes and which parameters are trainable must not.
    ``params`` are canonical specs (torch names and layouts).

    Raises:
        ValueError: one sentence saying what differs and how to fix it.
    """
    check_optimizer(
        manifest.framework, manifest.optimizer, framework or manifest.framework, optimizer
    )
    saved: Mapping[str, ParamSpec] = {p.name: p for p in manifest.params if p.requires_grad}
    mine = {p.name: p for p in params if p.requires_grad}
    for name, spec in mine.items():
        if name not in saved:
            raise ValueError(f"checkpoint has no state for parameter {name!r}: another model?")
        if (spec.shape, spec.dtype) != (saved[name].shape, saved[name].dtype):
            raise ValueError(
                f"parameter {name!r} is {spec.shape} {spec.dtype} here but "
                f"{saved[name].shape} {saved[name].dtype} in the checkpoint: another model?"
            )
    extra = sorted(set(saved) - set(mine))
    if extra:
        raise ValueError(
            f"checkpoint holds state for {len(extra)} parameter(s) this model lacks, "
            f"starting with {extra[0]!r}: another model?"
        )
