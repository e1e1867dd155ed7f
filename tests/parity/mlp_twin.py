"""The cross-framework tests' MLP problem: the Flax side of tests/parity/torch_worker.py.

A 12-layer MLP (``WIDTHS``; ``Dense_10`` sorts before ``Dense_2`` in Flax, so ordering bugs
show) on one batch, the Optax twins of the torch optimizers (``TORCH_HYPER``), and the
moments of an Optax state by torch name. ``RTOL`` is the cross-framework floor argued in
test_cross_checkpoint.py's docstring: 1e-5 relative for parameters, 5e-5 for moments.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradsync_jax import data_parallel_step, to_torch_state
from tests.parity.torch_worker import RENAMES, WIDTHS
from tests.support.models import LinenMLP

BATCH = 24  # divisible by 2, 3, 4 and 8 shards
RTOL = {"params": 1e-5, "state": 5e-5}
TORCH_HYPER = {
    "adamw": {"lr": 1e-2, "betas": (0.5, 0.75), "eps": 1e-8, "weight_decay": 0.1},
    "sgd": {"lr": 0.05, "momentum": 0.9},
}
MOMENTS = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ("momentum_buffer",)}


def optax_twin(name: str) -> optax.GradientTransformation:
    if name == "adamw":
        return optax.adamw(1e-2, b1=0.5, b2=0.75, eps=1e-8, weight_decay=0.1)
    return optax.sgd(0.05, momentum=0.9)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, WIDTHS[0])).astype(np.float32)
    return x, rng.normal(size=(BATCH, WIDTHS[-1])).astype(np.float32)


def train_jax(tx, params, opt_state, steps: int):
    model = LinenMLP(WIDTHS)

    def loss_fn(p, batch):
        return jnp.mean((model.apply(p, batch[0]) - batch[1]) ** 2)

    step = data_parallel_step(loss_fn, tx, tx.mesh)
    batch = tuple(jnp.asarray(a) for a in data())
    for _ in range(steps):
        params, opt_state, _ = step(params, opt_state, batch)
    return params, opt_state


def jax_moments(tx, opt_state, params, name: str, modules=RENAMES) -> dict[str, np.ndarray]:
    """The moments of a ``shard_optimizer`` state by ``"<torch name>/<torch key>"``."""
    return optax_moments(tx.gather_state(opt_state, params)[0], name, modules)


def optax_moments(inner, name: str, modules=RENAMES) -> dict[str, np.ndarray]:
    """The moments of an unsharded Optax state's first element (``ScaleByAdamState`` or
    ``TraceState``) by ``"<torch name>/<torch key>"``."""
    fields = {"exp_avg": "mu", "exp_avg_sq": "nu", "momentum_buffer": "trace"}
    out = {}
    for key in MOMENTS[name]:
        for param, value in to_torch_state(getattr(inner, fields[key]), modules=modules).items():
            out[f"{param}/{key}"] = value
    return out


def linen_init():
    return LinenMLP(WIDTHS).init(jax.random.key(0), jnp.zeros((1, WIDTHS[0])))
