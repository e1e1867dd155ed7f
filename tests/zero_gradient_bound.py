"""The stated bound between two runs that sum gradients in another order, including a
parameter whose true gradient is zero (docs/torch-zero3.md, "Checkpoints"; numpy only, so
torch workers and JAX tests share it).

Every tensor agrees within ``RTOL`` of its largest entry (tests/parity/test_cross_checkpoint.py:
4x the same-framework reduction-order floor) except a parameter whose true gradient is zero,
such as an attention key bias (softmax ignores the ``q . b`` it adds to every score of a row).
Its gradient is rounding noise, which Adam's ``m / sqrt(v)`` turns into steps of order ``lr``
in directions the rounding picks, so two runs move it apart by up to ``2 c lr`` a step
(``adam_step_bound``); its moments, noise themselves, agree only within ``RTOL`` of the
model's largest moment of the same kind.
"""

from __future__ import annotations

import numpy as np

RTOL = {"params": 1e-5, "state": 5e-5}


def adam_step_bound(b1: float, b2: float) -> float:
    """The largest ``|m_hat / sqrt(v_hat)|`` over any gradients (in units of ``lr``).

    Cauchy-Schwarz over the moments' weights gives ``(1 - b1) / sqrt((1 - b2)(1 - b1**2 / b2))``
    in the limit of many steps, which bounds every earlier step too (1 at the first); eps only
    lowers it. 1.22 for betas (0.5, 0.75), 7.27 for (0.9, 0.999).
    """
    return (1 - b1) / ((1 - b2) * (1 - b1**2 / b2)) ** 0.5


def assert_within_bound(
    got: dict[str, dict[str, np.ndarray]],
    want: dict[str, dict[str, np.ndarray]],
    *,
    zero_gradient: tuple[str, ...],
    lr: float,
    betas: tuple[float, float],
    steps: int,
) -> None:
    """Assert ``got`` is within the stated bound of ``want``.

    Args:
        got, want: ``{"params": {name: array}, "state": {f"{name}/{moment}": array}}``.
        zero_gradient: the names of parameters whose true gradient is zero.
        lr, betas: AdamW's learning rate and betas.
        steps: the Adam steps taken since the two runs started to differ.

    Raises:
        AssertionError: naming the first tensor outside its bound.
    """
    moment_scale: dict[str, float] = {}
    for key, value in want["state"].items():
        moment = key.rpartition("/")[2]
        moment_scale[moment] = max(moment_scale.get(moment, 0.0), float(np.abs(value).max()))
    assert sorted(got["params"]) == sorted(want["params"]), (got["params"], want["params"])
    assert sorted(got["state"]) == sorted(want["state"]), (got["state"], want["state"])
    for part in ("params", "state"):
        for key, value in want[part].items():
            error = float(np.abs(got[part][key] - value).max())
            name, _, moment = key.rpartition("/") if part == "state" else (key, "", "")
            if name not in zero_gradient:
                bound = RTOL[part] * (float(np.abs(value).max()) or 1.0)  # all zero: absolute
            elif part == "params":
                bound = 2 * adam_step_bound(*betas) * lr * steps
            else:
                bound = RTOL[part] * moment_scale[moment]
            assert error <= bound, f"{key}: error {error:.2e} > bound {bound:.2e}"
