"""Every Optax optimizer is either exact under zero3_step or refused: never silently wrong.

The counterpart of ``test_zero_sweep.py`` for ZeRO-3 (issue 33 item 2): the same cases (every
transformation ``optax`` and ``optax.contrib`` build with defaults, and the wrappers around
coupling transformations), each either refused by ``zero3_step`` with one sentence or run as
``zero3_step`` runs it, on each device's padded rows (``Zero3Step.rows_update``, its
whole-tensor reductions completed across the devices), 8 steps, and compared with the same
transformation unsharded: parameters and state, rtol 1e-5. The shapes cut every way at 4
devices: ``a`` one row each, ``b`` 10 rows as 3 + 3 + 3 + 1 and 2 padding rows, ``c`` 3 rows
with the last device all padding. Every case is built by ``zero3_step`` itself; the accepted
ones run in one ``shard_map`` program (one compilation, at LLVM's optimization level 0 as the
sweep's), and their unsharded references in another (``run_reference``).
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from gradsync_jax import clip_by_global_norm, param_layout, shard_params, zero3_step
from gradsync_jax.param_sharding.update import rows_tree
from gradsync_jax.zero.model_space import model_space
from tests.jax.sweep_cases import (
    CASES,
    SHAPES,
    STEPS,
    N,
    extra_args_of,
    key_data,
    local_grads,
    run_reference,
)
from tests.support.asserts import assert_tree_close
from tests.support.meshes import dp_mesh
from tests.support.models import mean_in_device_order, random_params
from tests.support.xla import FAST_COMPILE

pytestmark = pytest.mark.slow

# Cases whose update reads across tensors or across a tensor's elements, all of it through
# whole-tensor reductions, or Muon's matrices (stepped whole on their owners): zero3_step must
# run them (exactly), not refuse them.
RUN_EXACTLY = (
    "padding-sensitive reductions + sgd",
    "apply_if_finite(adam)",
    "optax.normalize_by_update_norm",
    "optax.scale_by_trust_ratio",
    "optax.contrib.dog",
    "multi_transform(clip+adam, sgd)",
    "optax.lamb",
    "optax.lars",
    "optax.chain(clip_by_global_norm, adam)",
    "optax.chain(gradsync clip, adam)",
    "chain(adam, clip_by_global_norm)",
    "chain(scale, gradsync clip, sgd)",
    "masked(clip_by_global_norm)+adam",
    "inject_hyperparams(clip_by_global_norm)+sgd",
    "optax.contrib.muon",  # each matrix whole on its owner (param_sharding/matrices.py)
)
# What zero3_step must refuse: a moment factored over a tensor's dims, an update that needs an
# extra argument zero3_step does not pass.
REFUSED = ("optax.adafactor", "optax.polyak_sgd")


def padding_sensitive() -> optax.GradientTransformation:
    """Whole-tensor reductions that a zero padding row would change: the smallest ``|g| + 1``
    (a padding row gives 1), the sum of ``exp(g)`` (1 per padding element), whether every
    element is nonzero (a padding element is not) and the largest ``-|g|`` (0 there)."""

    def update(updates: Any, state: Any, params: Any = None) -> Any:
        del params

        def one(g: jax.Array) -> jax.Array:
            low = jnp.min(jnp.abs(g) + 1.0)
            mass = jnp.sum(jnp.exp(g))
            nonzero = jnp.all(g != 0)
            top = jnp.max(-jnp.abs(g))
            return jnp.where(nonzero, g / low + 1e-3 * mass + top, g)

        return jax.tree.map(one, updates), state

    return optax.GradientTransformation(optax.init_empty_state, update)


def cases() -> dict[str, Any]:
    """The sweep's cases, the two chains a ZeRO-3 user writes first, and reductions that
    padding would change."""
    return {
        **CASES,
        "padding-sensitive reductions + sgd": optax.chain(padding_sensitive(), optax.sgd(1e-2)),
        "optax.chain(clip_by_global_norm, adam)": optax.chain(
            optax.clip_by_global_norm(1.0), optax.adam(1e-2)
        ),
        "optax.chain(gradsync clip, adam)": optax.chain(clip_by_global_norm(1.0), optax.adam(1e-2)),
    }


def build(cases: dict[str, Any], mesh: Mesh, layout: Any) -> tuple[list, dict]:
    """``zero3_step`` of every case: (accepted (name, step), outcome by name)."""
    accepted, outcomes = [], {}
    loss_fn = lambda params, batch: 0.0  # noqa: E731  never called: the step is not run
    for name, tx in cases.items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                step = zero3_step(loss_fn, tx, mesh, layout)
        except ValueError as err:
            message = str(err)
            assert "\n" not in message, f"{name}: not one sentence: {message}"
            assert "shard_optimizer(tx, mesh)" in message, (name, message)
            outcomes[name] = f"refused: {message}"
            continue
        accepted.append((name, step))
        outcomes[name] = "matches unsharded"
    return accepted, outcomes


def run_sharded(accepted: list, params: dict, mesh: Mesh, layout: Any) -> tuple[Any, Any]:
    """Every accepted case, STEPS steps on the same mean gradients, in one program."""
    steps = [step for _, step in accepted]
    specs = tuple(step.state_specs for step in steps)
    axes = ("dp",)

    def body(all_params: Any, states: Any, grads: Any) -> Any:
        out_p, out_s = [], []
        for step, p, s in zip(steps, all_params, states, strict=True):
            updates, s = step.rows_update(grads, s, p, axes)
            out_p.append(optax.apply_updates(p, updates))
            out_s.append(s)
        return tuple(out_p), tuple(out_s)

    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=(P("dp"), specs, P("dp")), out_specs=(P("dp"), specs)
    )
    run = jax.jit(mapped, compiler_options=FAST_COMPILE)
    init = jax.shard_map(
        lambda p: tuple(step.rows_update.init(p, axes) for step in steps),
        mesh=mesh,
        in_specs=(P("dp"),),
        out_specs=specs,
    )
    sharded = shard_params(params, mesh, layout)
    states = jax.jit(init, compiler_options=FAST_COMPILE)(sharded)
    all_params = tuple(sharded for _ in steps)
    for k in range(STEPS):
        grads = shard_params(mean_in_device_order(local_grads(k), N), mesh, layout)
        all_params, states = run(all_params, states, grads)
    return all_params, states


def unpadded_state(step: Any, state: Any, params: dict) -> list[Any]:
    """The state leaves as the unsharded optimizer holds them: each row-sharded leaf of a
    parameter cut back to its rows (the shapes here need no transposition)."""
    space = model_space(step.tx, rows_tree(step.layout, lambda leaf: leaf.rows))
    rows = [leaf.rows for leaf in step.layout.leaves]
    specs = jax.tree.leaves(step.state_specs, is_leaf=lambda x: isinstance(x, P))
    out = []
    for leaf, spec, value in zip(space.leaves, specs, jax.tree.leaves(state), strict=True):
        value = key_data(value)
        out.append(np.asarray(value)[: rows[leaf.param]] if spec != P() else np.asarray(value))
    return out


def test_every_optax_optimizer_is_exact_or_refused_under_zero3() -> None:
    mesh = dp_mesh(N)
    params = random_params(SHAPES)
    layout = param_layout(params, world_size=N)
    all_cases = cases()
    accepted, outcomes = build(all_cases, mesh, layout)
    for name in RUN_EXACTLY:
        assert outcomes[name] == "matches unsharded", (name, outcomes[name])
    for name in REFUSED:
        assert outcomes[name].startswith("refused"), (name, outcomes[name])
    for name, _ in accepted:  # zero3_step passes no extra argument: the unsharded neither
        assert extra_args_of(all_cases[name], params) == {}, name
    references = run_reference([(n, all_cases[n], {}) for n, _ in accepted], params)
    all_params, states = run_sharded(accepted, params, mesh, layout)
    for (name, step), p, s in zip(accepted, all_params, states, strict=True):
        ref_p, ref_s = references[name]
        got_p = {k: np.asarray(v)[: params[k].shape[0]] for k, v in p.items()}
        assert_tree_close(got_p, ref_p, rtol=1e-5, atol_rel=1e-5, what=f"parameters of {name}")
        assert_tree_close(
            unpadded_state(step, s, params),
            [np.asarray(x) for x in jax.tree.leaves(key_data(ref_s))],
            rtol=1e-5,
            atol_rel=1e-5,
            what=f"state of {name}",
        )
    width = max(len(n) for n in outcomes)
    print("\n" + "\n".join(f"{n:{width}s} {o}" for n, o in outcomes.items()))
