"""The values a ZeRO checkpoint load checks before any rank's state changes (docs/design.md §9).

A forged or corrupt file that parses can still hold an ``exp_avg`` of the wrong shape (the
first step crashes on its owner only), a state tensor of another dtype (torch's
``load_state_dict`` silently casts it to the parameter's), or NaNs (the weights are NaN two
steps later). Each rank checks what it read here, inside ``checkpoint.zero.load``'s read, so a
bad value fails the load on every rank through the ranks' agreement and no rank's state
changes. Scalars (``step``, hyper-parameters) are checked by range in the manifest itself
(``gradsync_core.Manifest.from_json``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch

from gradsync_core import ParamSpec
from gradsync_torch._optim_state import StatePiece
from gradsync_torch._specs import dtype_name


class ValuePolicy(NamedTuple):
    """What a load lets through that it refuses by default (``ZeroRedundancyOptimizer.load``)."""

    allow_nonfinite: bool = False  # NaN/inf in state tensors or model weights
    allow_dtype_conversion: bool = False  # state of another dtype, cast to the parameter's


def check_state_values(
    full: Mapping[int, Mapping[str, Any]],
    specs: Sequence[ParamSpec],
    policy: ValuePolicy,
    shapes: Sequence[tuple[int, ...]] | None = None,
) -> None:
    """Refuse state (model-space, by global parameter index) that does not fit its parameter:
    a tensor of another shape (the parameter's, or ``shapes[index]`` when a load keeps only
    some rows) or dtype, or a non-finite value, unless ``policy`` allows it.

    Raises:
        ValueError: one sentence naming the parameter, the state key, what was found and the fix.
    """
    for index, state in full.items():
        spec = specs[index]
        expected = tuple(spec.shape if shapes is None else shapes[index])
        for key, value in state.items():
            if not torch.is_tensor(value):
                continue
            where = f"state {key!r} of {spec.name!r}"
            if value.dim() >= 1 and tuple(value.shape) != expected:
                raise ValueError(
                    f"{where} has the wrong shape: {tuple(value.shape)} in the checkpoint, "
                    f"{expected} here; the file is corrupt or of another model"
                )
            found = dtype_name(value.dtype)
            if value.dim() >= 1 and found != spec.dtype and not policy.allow_dtype_conversion:
                raise ValueError(
                    f"{where} is {found} in the checkpoint but the parameter is {spec.dtype}; "
                    "pass allow_dtype_conversion=True to load() to cast it"
                )
            _check_finite(value, where, policy)


def check_slice_lengths(pieces: Sequence[StatePiece], specs: Sequence[ParamSpec]) -> None:
    """Refuse a flat (ZeRO-2) slice whose length is not its shard's ``stop - start``, before
    the slices are joined (where it would be an unnamed reshape error, or, if two wrong lengths
    added up, state shifted between elements).

    Raises:
        ValueError: naming the parameter, the state key, the shard and the length found.
    """
    for piece in pieces:
        if piece.whole:
            continue
        want = piece.stop - piece.start
        for key, value in piece.state.items():
            if torch.is_tensor(value) and tuple(value.shape) != (want,):
                raise ValueError(
                    f"state {key!r} of {specs[piece.index].name!r} has the wrong shape: "
                    f"{tuple(value.shape)} in the checkpoint for elements [{piece.start}, "
                    f"{piece.stop}), ({want},) expected; the file is corrupt or of another model"
                )


def check_finite_weights(weights: Mapping[str, torch.Tensor], policy: ValuePolicy) -> None:
    """Refuse model weights holding NaN or inf unless ``policy`` allows them.

    Raises:
        ValueError: naming the weight.
    """
    for name, value in weights.items():
        _check_finite(value, f"weight {name!r}", policy)


def _check_finite(value: torch.Tensor, where: str, policy: ValuePolicy) -> None:
    if policy.allow_nonfinite or not value.is_floating_point():
        return
    if not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise ValueError(
            f"{where} holds {bad} NaN or infinite value(s) in the checkpoint; load an earlier "
            "checkpoint, or pass allow_nonfinite=True to take them as they are"
        )
