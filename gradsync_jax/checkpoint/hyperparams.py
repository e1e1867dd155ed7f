"""An Optax transformation's hyper-parameters, measured from what it computes (docs/checkpoints.md).

Optax keeps an optimizer's hyper-parameters in the closures of its transformation
(``optax.adamw(1e-3)``), where no public API reads them. A checkpoint that crosses frameworks
compares them with torch's param groups (``HYPERPARAMETERS`` of ``gradsync_core.checkpoint``),
so they are measured the way the optimizer is named: by what it computes (``optimizers.py``).
Two updates of a three-element probe parameter, from the state ``inner.init`` makes with its
step counts set to ``count``, the loaded step (Adam's bias correction depends on it; a
schedule would give that step's learning rate, as torch's param group holds the current one):

- step 1, gradient ``(G, 0, eps)``, parameter ``(0, 1, 0)``: the first element's update is
  ``-lr`` times Adam's bias-corrected ratio, the second's is the decoupled decay
  ``-lr * weight_decay`` (AdamW), and the third's ratio gives ``eps``; for SGD ``-lr * G``;
- step 2, gradient 0 with the same parameter: each moment decays by its own factor alone
  (``mu2 / mu1 = b1``, ``nu2 / nu1 = b2``, ``trace2 / trace1 = momentum``), whatever
  stateless scaling or clipping runs before the optimizer.

An L2 weight decay added to the gradient before the moments (torch Adam's and SGD's
``weight_decay``: ``chain(add_decayed_weights(wd), adam(...))``) shows in the first moment
of the second element. Measured in float32: the core compares within its tolerance.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

_G = 1e-3  # small: a clipping threshold rarely binds, and Adam's ratio is scale-free


def _with_count(state: Any, count: int) -> Any:
    """``state`` with every ``count`` field (Adam's, a schedule's) set to ``count``."""

    def put(path: tuple[Any, ...], leaf: Any) -> Any:
        if path and getattr(path[-1], "name", None) == "count":
            return jnp.asarray(count, jnp.asarray(leaf).dtype)
        return leaf

    return jax.tree_util.tree_map_with_path(put, state)


def _field(state: Any, name: str) -> np.ndarray | None:
    """The probe's value of the one state field ``name`` (``mu``), or ``None``."""
    found = [
        np.asarray(leaf, np.float64)
        for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]
        if any(getattr(key, "name", None) == name for key in path)
    ]
    return found[0] if len(found) == 1 else None


def measure_hyperparams(
    inner: optax.GradientTransformation, optimizer: str, count: int, eps: float = 1e-8
) -> dict[str, Any] | None:
    """The hyper-parameters the canonical ``optimizer`` (``"adamw"``) ``inner`` computes
    with, under torch's names (``lr``, ``betas``, ``eps``, ``weight_decay``, ``momentum``);
    ``None`` if it cannot be probed (another chain, or extra arguments it needs).

    Args:
        inner: a plain Optax transformation (a ``shard_optimizer``'s ``settings.inner``).
        optimizer: its canonical name (``gradsync_jax.checkpoint.optimizers``).
        count: the step count whose learning rate is measured (a schedule's value there).
        eps: the epsilon expected (the checkpoint's), the gradient that measures it best.

    Example:
        >>> round(measure_hyperparams(optax.sgd(0.1, momentum=0.9), "sgd_momentum", 0)["lr"], 6)
        0.1
    """
    eps = eps if isinstance(eps, float) and eps > 0 else 1e-8
    params = {"probe": jnp.asarray([0.0, 1.0, 0.0], jnp.float32)}
    first = {"probe": jnp.asarray([_G, 0.0, eps], jnp.float32)}
    zero = {"probe": jnp.zeros(3, jnp.float32)}
    try:
        start = _with_count(inner.init(params), int(count))
        updates, state1 = inner.update(first, start, params)
        _, state2 = inner.update(zero, state1, params)  # the same parameter: no decay enters
    except Exception:  # a chain that needs extra arguments: nothing to compare
        return None
    update = np.asarray(updates["probe"], np.float64)
    if optimizer in ("sgd", "sgd_momentum"):
        out: dict[str, Any] = {"lr": float(-update[0] / _G)}
        out["weight_decay"] = float(-update[1] / out["lr"]) if out["lr"] else 0.0
        if optimizer == "sgd_momentum":
            trace1, trace2 = _field(state1, "trace"), _field(state2, "trace")
            if trace1 is None or trace2 is None or not trace1[0]:
                return None
            out["momentum"] = float(trace2[0] / trace1[0])
        return out
    mu1, mu2, nu1, nu2 = (_field(s, k) for k in ("mu", "nu") for s in (state1, state2))
    if mu1 is None or mu2 is None or nu1 is None or nu2 is None or not (mu1[0] and nu1[0]):
        return None
    b1, b2 = float(mu2[0] / mu1[0]), float(nu2[0] / nu1[0])
    t = int(count) + 1  # Adam's bias correction of the update after ``count`` steps
    c1 = (1.0 - b1) / (1.0 - b1**t) if b1 != 1.0 else 1.0
    c2 = math.sqrt((1.0 - b2) / (1.0 - b2**t)) if b2 != 1.0 else 1.0
    # update[0] = -lr * c1 G / (c2 G + eps), update[2] = -lr * c1 E / (c2 E + eps), E = eps:
    # solved by turns, eps barely moving lr (G is 1e5 times eps).
    measured_eps, lr = eps, 0.0
    for _ in range(3):
        lr = -update[0] * (c2 * _G + measured_eps) / (c1 * _G)
        if update[2]:
            measured_eps = eps * c1 * lr / abs(update[2]) - eps * c2
    if optimizer == "adamw":
        decay = -update[1] / lr if lr else 0.0
    else:  # L2: the decay entered the gradient, so the first moment
        decay = mu1[1] / (1.0 - b1) if b1 != 1.0 else 0.0
    return {
        "lr": float(lr),
        "betas": [b1, b2],
        "eps": float(measured_eps),
        "weight_decay": float(decay),
    }
