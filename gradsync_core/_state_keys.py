"""Where torch and Optax optimizer state meet: one key map, one table of counterparts.

A version-2 checkpoint names state by torch's keys (``exp_avg``, ``exp_avg_sq``,
``momentum_buffer``, ``step``): the canonical keys (docs/design.md §9). The JAX executor
maps Optax's fields through ``TORCH_TO_OPTAX_STATE`` when it writes and reads; this module
is the only place that map is spelled out. A checkpoint crosses frameworks only between an
optimizer and its listed counterpart, so an RMSprop state is never read as Adam's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from gradsync_core._specs import ParamSpec

# The one place torch and Optax state names meet: torch.optim key -> optax field.
TORCH_TO_OPTAX_STATE = {
    "exp_avg": "mu",
    "exp_avg_sq": "nu",
    "step": "count",
    "momentum_buffer": "trace",
}
OPTAX_TO_TORCH_STATE = {v: k for k, v in TORCH_TO_OPTAX_STATE.items()}

# torch optimizer -> the Optax state signatures (``gradsync_jax`` names them after the state
# types of ``inner.init``) whose arithmetic is the same, with the canonical per-parameter keys
# both keep. SGD without momentum keeps no state on either side.
COUNTERPARTS: dict[str, dict[str, tuple[str, ...]]] = {
    "torch.optim.Adam": {"optax:ScaleByAdamState,EmptyState": ("exp_avg", "exp_avg_sq", "step")},
    "torch.optim.AdamW": {
        "optax:ScaleByAdamState,EmptyState,EmptyState": ("exp_avg", "exp_avg_sq", "step")
    },
    "torch.optim.SGD": {
        "optax:TraceState,EmptyState": ("momentum_buffer",),
        "optax:EmptyState,EmptyState": (),
    },
}


def canonical_state_key(framework: str, key: str) -> str:
    """The checkpoint key of a state entry: torch's key as is, an Optax field mapped back."""
    return OPTAX_TO_TORCH_STATE.get(key, key) if framework == "jax" else key


def framework_state_key(framework: str, key: str) -> str:
    """The key ``framework`` uses for the canonical checkpoint key ``key``."""
    return TORCH_TO_OPTAX_STATE.get(key, key) if framework == "jax" else key


def counterpart_keys(torch_optimizer: str, optax_optimizer: str) -> tuple[str, ...] | None:
    """The canonical per-parameter keys a torch/Optax pair keeps, or None if not a pair."""
    return COUNTERPARTS.get(torch_optimizer, {}).get(optax_optimizer)


def check_optimizer(
    saved_framework: str, saved_optimizer: str, framework: str, optimizer: str
) -> None:
    """Refuse a checkpoint of an optimizer that is neither this one nor its counterpart.

    Raises:
        ValueError: naming both optimizers.
    """
    if saved_framework == framework:
        if saved_optimizer != optimizer:
            raise ValueError(
                f"checkpoint was written by optimizer {saved_optimizer!r}, this one is "
                f"{optimizer!r}; load it with the same optimizer class"
            )
        return
    torch_name, optax_name = (
        (saved_optimizer, optimizer) if saved_framework == "torch" else (optimizer, saved_optimizer)
    )
    if counterpart_keys(torch_name, optax_name) is None:
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
