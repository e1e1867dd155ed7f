"""Hyper-parameters of a checkpoint that crosses frameworks (docs/checkpoints.md).

torch keeps an optimizer's hyper-parameters in its param groups, which a torch manifest
records (``extra["param_groups"]``) and a torch load restores. Optax keeps them in the
transformation, which no load can change: a JAX load of a torch checkpoint, and a torch load
of a JAX one, continue with the hyper-parameters of the optimizer in hand. Where those differ
from the saved ones (Optax's default AdamW weight decay is 1e-4, torch's 0.01) the loader
warns with ``HyperparameterWarning``, naming each difference; the state loads as saved.

Values are compared by the canonical optimizer's hyper-parameters under torch's names
(``HYPERPARAMETERS``); the JAX side measures its own from what the transformation computes
(``gradsync_jax/checkpoint/hyperparams.py``) and a JAX save records them as
``extra["hyperparams"]``. Measured in float32, so values count as equal within ``RTOL``
(betas by ``1 - beta``, where their difference shows).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

# Canonical optimizer -> the hyper-parameters both frameworks' versions have (torch's names;
# ``weight_decay`` is what torch's class means by it: decoupled for AdamW, L2 otherwise).
HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay"),
    "adamw": ("lr", "betas", "eps", "weight_decay"),
    "sgd_momentum": ("lr", "momentum", "weight_decay"),
    "sgd": ("lr", "weight_decay"),
}
RTOL = 1e-3  # far above float32 measurement (about 1e-5), far below a real difference


class HyperparameterWarning(UserWarning):
    """A checkpoint crossing frameworks was saved with other hyper-parameters than the
    optimizer it loads into, which keeps its own.

    Silence it with ``warnings.filterwarnings("ignore", category=HyperparameterWarning)``
    where the change is meant (a new learning rate for fine-tuning).
    """


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b)) + 1e-12


def _same(key: str, saved: Any, here: Any) -> bool:
    if key == "betas":  # 0.999 and 0.9999 differ in 1 - beta
        pairs = list(zip(saved, here, strict=True))
        return all(_close(1.0 - float(a), 1.0 - float(b)) for a, b in pairs)
    return _close(float(saved), float(here))


def _shown(value: Any) -> str:
    if isinstance(value, list | tuple):
        return "(" + ", ".join(_shown(v) for v in value) + ")"
    return f"{float(value):.4g}"  # measured values carry float32 noise past 4 digits


def _comparable(value: Any) -> bool:
    if isinstance(value, list | tuple):
        return len(value) > 0 and all(_comparable(v) for v in value)
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def hyperparameter_differences(
    saved: Mapping[str, Any], here: Mapping[str, Any], optimizer: str
) -> list[str]:
    """``"weight_decay 0.01 in the checkpoint, 0.0001 here"`` for each hyper-parameter of the
    canonical ``optimizer`` whose values differ; one that either side lacks is not compared.

    Example:
        >>> hyperparameter_differences({"lr": 1e-3, "weight_decay": 0.01},
        ...                            {"lr": 1e-3, "weight_decay": 1e-4}, "adamw")
        ['weight_decay 0.01 in the checkpoint, 0.0001 here']
    """
    out = []
    for key in HYPERPARAMETERS.get(optimizer, ()):
        a: Any = saved.get(key)
        b: Any = here.get(key)
        if not (_comparable(a) and _comparable(b)):
            continue
        if key == "betas" and len(a) != len(b):
            continue
        if not _same(key, a, b):
            out.append(f"{key} {_shown(a)} in the checkpoint, {_shown(b)} here")
    return out


def hyperparameter_warning(
    path: str,
    saved_optimizer: str,
    saved: Sequence[Mapping[str, Any]],
    here: Sequence[Mapping[str, Any]],
    optimizer: str,
    *,
    keeps: str,
) -> str | None:
    """The message of a ``HyperparameterWarning``, or ``None`` when nothing differs.

    For loading ``path`` (saved by ``saved_optimizer`` with the param groups ``saved``) into an
    optimizer whose groups are ``here`` (canonical ``optimizer``). A side with one group
    (Optax's transformation) is compared with every group of the other.

    Args:
        keeps: why the loaded optimizer's values stay (said in the message).
    """
    if not saved or not here:
        return None
    count = max(len(saved), len(here))
    if min(len(saved), len(here)) not in (1, count):
        return None  # groups that do not pair up: the loaders refuse those already
    parts: list[str] = []
    for group in range(count):
        found = hyperparameter_differences(
            saved[min(group, len(saved) - 1)], here[min(group, len(here) - 1)], optimizer
        )
        prefix = f"param group {group}: " if count > 1 else ""
        parts.extend(prefix + difference for difference in found)
    if not parts:
        return None
    return (
        f"checkpoint {path} ({saved_optimizer}) was saved with other hyper-parameters than "
        f"this optimizer's: {'; '.join(parts)}. The state loads as saved; {keeps}, so the next "
        "steps use this optimizer's values: build it with the checkpoint's to continue the "
        "same run, or silence this with warnings.filterwarnings('ignore', "
        "category=gradsync_core.HyperparameterWarning)"
    )
