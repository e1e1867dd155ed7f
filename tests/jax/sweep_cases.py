"""The optimizers the ZeRO sweeps run, their inputs and their unsharded reference.

``CASES``: every public ``optax`` / ``optax.contrib`` function that builds a transformation by
default, plus wrappers around transformations that couple tensors (test_zero_sweep.py runs
them under ``shard_optimizer``, test_zero3_sweep.py under ``zero3_step``); ``rule_cases``: the
per-parameter rules (test_zero_rules.py, run in test_zero_coupled.py's program). Parameters
are ``random_params(SHAPES)``; device d's gradient at step k is row d of ``local_grads(k, n)``.
"""

from __future__ import annotations

import inspect
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib

from gradsync_jax import clip_by_global_norm
from tests.support.models import mean_in_device_order
from tests.support.xla import FAST_COMPILE

N = 4
STEPS = 8
SHAPES = {"a": (4, 6), "b": (10,), "c": (3, 5)}


def enumerated() -> dict[str, Any]:
    """Every public optax / optax.contrib function that builds a transformation by default."""
    cases = {}
    for module in (optax, optax.contrib):
        for name in sorted(dir(module)):
            fn = getattr(module, name)
            if name.startswith("_") or not inspect.isfunction(fn):
                continue
            for kwargs in ({}, {"learning_rate": 1e-2}):
                try:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")
                        tx = fn(**kwargs)
                except Exception:
                    continue
                if isinstance(tx, optax.GradientTransformation):
                    cases[f"{module.__name__}.{name}"] = tx
                break
    return cases


def wrapped() -> dict[str, Any]:
    """Wrappers around transformations that couple tensors or are not elementwise."""
    clip_adam = optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-2))
    labels = {"a": "clip", "b": "plain", "c": "plain"}
    return {
        "MultiSteps(chain(clip_by_global_norm, adam), 2)": optax.MultiSteps(clip_adam, 2),
        "MultiSteps(lamb, 4)": optax.MultiSteps(optax.lamb(1e-2), 4),
        "MultiSteps(lars, 4)": optax.MultiSteps(optax.lars(1e-2), 4),
        "MultiSteps(adam, 3)": optax.MultiSteps(optax.adam(1e-2), 3),
        "multi_transform(clip+adam, sgd)": optax.multi_transform(
            {"clip": clip_adam, "plain": optax.sgd(1e-2)}, labels
        ),
        "multi_transform(adam 1e-2, adam 1e-3)": optax.multi_transform(
            {"clip": optax.adam(1e-2), "plain": optax.adam(1e-3)}, labels
        ),
        "masked(clip_by_global_norm)+adam": optax.chain(
            optax.masked(optax.clip_by_global_norm(1.0), {"a": True, "b": True, "c": False}),
            optax.adam(1e-2),
        ),
        "inject_hyperparams(clip_by_global_norm)+sgd": optax.chain(
            optax.inject_hyperparams(optax.clip_by_global_norm)(max_norm=1.0), optax.sgd(1e-2)
        ),
        "inject_hyperparams(adamw)(schedule)": optax.inject_hyperparams(optax.adamw)(
            learning_rate=optax.linear_schedule(1e-2, 1e-3, STEPS)
        ),
        "apply_if_finite(adam)": optax.apply_if_finite(optax.adam(1e-2), 3),
        "lookahead(adam)": optax.lookahead(optax.adam(1e-2), 2, 0.5),
        "adamw(mask by size)": optax.adamw(
            1e-2, mask=lambda p: jax.tree.map(lambda x: x.size > 12, p)
        ),
        # Per-parameter rules a flat layout of one bucket per parameter runs (issue 26).
        "adamw(mask by rank)": optax.adamw(
            1e-2, mask=lambda p: jax.tree.map(lambda x: x.ndim > 1, p)
        ),
        "multi_transform by path(adamw, adam)": optax.multi_transform(
            {"clip": optax.adamw(1e-2, weight_decay=0.1), "plain": optax.adam(1e-3)},
            lambda p: jax.tree_util.tree_map_with_path(
                lambda path, _: "plain" if path[-1].key == "b" else "clip", p
            ),
        ),
        "multi_transform(adam, set_to_zero) (frozen b)": optax.multi_transform(
            {"clip": optax.adam(1e-2), "plain": optax.set_to_zero()},
            {"a": "clip", "b": "plain", "c": "clip"},
        ),
        "MultiSteps(chain(gradsync clip, adam), 2)": optax.MultiSteps(
            optax.chain(clip_by_global_norm(1.0), optax.adam(1e-2)), 2
        ),
        "mechanize(adam)": optax.contrib.mechanize(optax.adam(1e-2)),
        "chain(adam, clip_by_global_norm)": optax.chain(
            optax.adam(1e-2), optax.clip_by_global_norm(1.0)
        ),
        "chain(scale, gradsync clip, sgd)": optax.chain(
            optax.scale(2.0), clip_by_global_norm(1.0), optax.sgd(1e-2)
        ),
        "multi_transform(gradsync clip+adam, sgd)": optax.multi_transform(
            {
                "clip": optax.chain(clip_by_global_norm(1.0), optax.adam(1e-2)),
                "plain": optax.sgd(1e-2),
            },
            labels,
        ),
    }


CASES = {**enumerated(), **wrapped()}
COUPLED = (  # cases that read every parameter: auto must run them gathered
    "optax.polyak_sgd",
    "optax.contrib.prodigy",
    "optax.contrib.dog",
    "optax.contrib.dadapt_adamw",
    "optax.noisy_sgd",
    "apply_if_finite(adam)",
    "mechanize(adam)",
    "MultiSteps(chain(clip_by_global_norm, adam), 2)",
    "chain(adam, clip_by_global_norm)",
    "chain(scale, gradsync clip, sgd)",
    "multi_transform(gradsync clip+adam, sgd)",
)


def key_data(tree: Any) -> Any:
    """PRNG keys (noisy_sgd's state) as their key data, so they compare as arrays."""
    extended = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended)  # noqa: E731
    return jax.tree.map(lambda x: jax.random.key_data(x) if extended(x) else x, tree)


def local_grads(step: int, n: int = N) -> dict:
    """``(n, ...)`` per parameter: row d is device d's local gradient at ``step``."""
    rng = np.random.default_rng(100 + step)
    return {k: jnp.asarray(rng.normal(0, 1, (n, *s)), jnp.float32) for k, s in SHAPES.items()}


def loss_value(step: int) -> jax.Array:
    return jnp.float32(2.0 / (1 + step))  # the global mean loss handed as value=


def extra_args_of(tx: Any, params: dict) -> dict | None:
    """``{}`` or ``{"value": ...}`` as the unsharded update needs; None if it cannot run."""
    tx = optax.with_extra_args_support(tx)
    state = jax.eval_shape(tx.init, params)
    for extra in ({}, {"value": loss_value(0)}):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                jax.eval_shape(
                    lambda g, s, p, e: tx.update(g, s, p, **e), params, state, params, extra
                )
        except Exception:
            continue
        return extra
    return None


def run_reference(cases: list[tuple[str, Any, dict]], params: dict) -> dict[str, tuple[Any, Any]]:
    """The unsharded run of each case, by name (once per case, however many partitions)."""
    cases = list({name: (name, tx, extra) for name, tx, extra in cases}.values())
    txs = [optax.with_extra_args_support(tx) for _, tx, _ in cases]

    @jax.jit(compiler_options=FAST_COMPILE)
    def step(all_params, states, grads, value):
        out_p, out_s = [], []
        for tx, (_, _, extra), p, s in zip(txs, cases, all_params, states, strict=True):
            e = {k: value for k in extra}
            updates, s = tx.update(grads, s, p, **e)
            out_p.append(optax.apply_updates(p, updates))
            out_s.append(s)
        return out_p, out_s

    all_params = [params] * len(txs)
    init = jax.jit(lambda p: [tx.init(p) for tx in txs], compiler_options=FAST_COMPILE)
    states = init(params)  # one compilation
    for k in range(STEPS):
        all_params, states = step(
            all_params, states, mean_in_device_order(local_grads(k), N), loss_value(k)
        )
    results = zip(all_params, states, strict=True)
    return {name: r for (name, _, _), r in zip(cases, results, strict=True)}


def ndim_mask(params):
    return jax.tree.map(lambda x: x.ndim > 1, params)  # no decay on biases: the usual rule


def path_labels(params):
    return jax.tree_util.tree_map_with_path(
        lambda path, _: "plain" if path[-1].key == "b" else "decay", params
    )


def rule_cases() -> dict:
    """name -> transformation deciding per parameter (run in test_zero_coupled.py)."""
    adamw = optax.adamw(1e-2, weight_decay=0.1)
    return {
        "adamw(mask=ndim>1)": optax.adamw(1e-2, weight_decay=0.1, mask=ndim_mask),
        "adamw(mask tree)": optax.adamw(
            1e-2, weight_decay=0.1, mask={"a": True, "b": False, "c": True}
        ),
        "masked(adam, ndim>1)": optax.masked(optax.adam(1e-2), ndim_mask),
        "multi_transform by path": optax.multi_transform(
            {"decay": adamw, "plain": optax.adam(1e-3)}, path_labels
        ),
        "frozen b (set_to_zero)": optax.multi_transform(
            {"train": optax.adam(1e-2), "frozen": optax.set_to_zero()},
            {"a": "train", "b": "frozen", "c": "train"},
        ),
    }
