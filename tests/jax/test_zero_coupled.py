"""Optimizers whose update reads every parameter run sharded, exactly (issue 26 item 1).

Global norms, sums over all leaves, learning-rate estimates and finite checks: under
``partition="auto"`` (and ``"gathered"``) each case runs 6 steps at 2, 4 and 8 devices and
must match the same transformation unsharded, fed the mean of the same local gradients:
parameters and the gathered state, rtol 1e-5. All cases of one device count run in one
``shard_map`` program (one compilation), the per-parameter rules of ``test_zero_rules.py``
included. Both programs compile at LLVM's optimization level 0 (``FAST_COMPILE``, as the
sweep's: the arithmetic compared is the same, the machine code unoptimized). The unsharded
program does not depend on the device count (it is fed the mean gradient, of the parameters'
shapes): the cases and that program are built once for the three counts (module fixture), and
each count's transformations are the same objects, so planning reuses their analysis.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_jax import clip_by_global_norm, shard_optimizer
from gradsync_jax.zero.flat import FlatLayout
from gradsync_jax.zero.gathered import GatheredLayout
from tests.jax.sweep_cases import (
    SHAPES,
    key_data,
    local_grads,
    loss_value,
    rule_cases,
)
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import mean_in_device_order, random_params
from tests.support.xla import FAST_COMPILE

pytestmark = pytest.mark.slow

STEPS = 6
LABELS = {"a": "x", "b": "y", "c": "y"}
COUPLED = (
    "polyak_sgd",
    "prodigy",
    "dog",
    "dadapt_adamw",
    "mechanize(adam)",
    "apply_if_finite(adam)",
    "noisy_sgd",
    "chain(clip, adam)",
)


def _clip() -> Any:
    return optax.clip_by_global_norm(0.5)


def _cases() -> dict[str, tuple[Any, bool]]:
    """name -> (transformation, whether its update takes value=)."""
    adam = optax.adam(1e-2)
    return {
        "polyak_sgd": (optax.polyak_sgd(), True),
        "prodigy": (optax.contrib.prodigy(), False),
        "dog": (optax.contrib.dog(), False),
        "dadapt_adamw": (optax.contrib.dadapt_adamw(), False),
        "mechanize(adam)": (optax.contrib.mechanize(adam), False),
        "apply_if_finite(adam)": (optax.apply_if_finite(adam, 3), False),
        "noisy_sgd": (optax.noisy_sgd(1e-2, key=jax.random.key(3)), False),
        "sm3": (optax.sm3(1e-2), False),
        "chain(clip, adam)": (optax.chain(_clip(), adam), False),
        "chain(adam, clip)": (optax.chain(adam, _clip()), False),
        "chain(scale, clip, sgd)": (optax.chain(optax.scale(2.0), _clip(), optax.sgd(1e-2)), False),
        "chain(adam, gradsync clip)": (optax.chain(adam, clip_by_global_norm(0.5)), False),
        "MultiSteps(chain(clip, adam), 2)": (
            optax.MultiSteps(optax.chain(_clip(), adam), 2),
            False,
        ),
        "MultiSteps(chain(gradsync clip, adam), 2)": (
            optax.MultiSteps(optax.chain(clip_by_global_norm(0.5), adam), 2),
            False,
        ),
        "multi_transform(clip+adam, sgd)": (
            optax.multi_transform({"x": optax.chain(_clip(), adam), "y": optax.sgd(1e-2)}, LABELS),
            False,
        ),
        "multi_transform(gradsync clip+adam, sgd)": (
            optax.multi_transform(
                {"x": optax.chain(clip_by_global_norm(0.5), adam), "y": optax.sgd(1e-2)}, LABELS
            ),
            False,
        ),
    }


class Reference:
    """The unsharded run of every case: one jitted step, compiled once for all device counts
    (only the mean gradients it is fed differ)."""

    def __init__(self, cases: list[tuple[Any, bool]]) -> None:
        self.txs = [optax.with_extra_args_support(tx) for tx, _ in cases]
        self.needs = [needs for _, needs in cases]
        self.step = jax.jit(self._step, compiler_options=FAST_COMPILE)

    def _step(self, all_params: Any, states: Any, grads: Any, value: Any) -> Any:
        out_p, out_s = [], []
        for tx, needs, p, s in zip(self.txs, self.needs, all_params, states, strict=True):
            updates, s = tx.update(grads, s, p, **({"value": value} if needs else {}))
            out_p.append(optax.apply_updates(p, updates))
            out_s.append(s)
        return out_p, out_s

    def run(self, params: dict, n: int) -> list[tuple[Any, Any]]:
        all_params, states = [params] * len(self.txs), [tx.init(params) for tx in self.txs]
        for k in range(STEPS):
            grads = mean_in_device_order(local_grads(k, n), n)
            all_params, states = self.step(all_params, states, grads, loss_value(k))
        return list(zip(all_params, states, strict=True))


@pytest.fixture(scope="module")
def every_case() -> tuple[dict[str, tuple[Any, bool]], dict[str, Any], Reference]:
    """(name -> (transformation, takes value=), the rule cases, the unsharded program)."""
    # The per-parameter rules of test_zero_rules.py run in the same program (one compilation
    # per device count instead of two); they must take flat by parameter (issue 26 item 2).
    rules = rule_cases()
    cases = {**_cases(), **{name: (tx, False) for name, tx in rules.items()}}
    return cases, rules, Reference(list(cases.values()))


def sharded(runs: list[tuple[Any, bool]], params: dict, mesh: Any, n: int) -> list[Any]:
    specs = tuple(tx.state_specs(params) for tx, _ in runs)

    @jax.jit(compiler_options=FAST_COMPILE)
    @jax.shard_map(mesh=mesh, in_specs=(P(), specs, P("dp"), P()), out_specs=(P(), specs))
    def step(all_params, states, grads, value):
        grads = jax.tree.map(lambda g: g[0], grads)
        out_p, out_s = [], []
        for (tx, needs), p, s in zip(runs, all_params, states, strict=True):
            updates, s = tx.update(grads, s, p, **({"value": value} if needs else {}))
            out_p.append(optax.apply_updates(p, updates))
            out_s.append(s)
        return tuple(out_p), tuple(out_s)

    all_params = tuple(jax.device_put(params, NamedSharding(mesh, P())) for _ in runs)
    states = tuple(tx.init(params) for tx, _ in runs)
    for k in range(STEPS):
        grads = jax.device_put(local_grads(k, n), NamedSharding(mesh, P("dp")))
        all_params, states = step(all_params, states, grads, loss_value(k))
    return [
        (p, key_data(tx.gather_state(s, params)))
        for (tx, _), p, s in zip(runs, all_params, states, strict=True)
    ]


@pytest.mark.parametrize("n", [2, 4, 8], ids=lambda n: f"n{n}")
def test_coupled_optimizers_match_unsharded(n: int, every_case: Any) -> None:
    cases, rules, reference = every_case
    mesh = mesh_of(n)
    params = random_params(SHAPES)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        runs = [(shard_optimizer(tx, mesh), needs) for tx, needs in cases.values()]
        got = sharded(runs, params, mesh, n)
        want = [(p, key_data(s)) for p, s in reference.run(params, n)]
    for name, (tx, _), (p, s), (ref_p, ref_s) in zip(cases, runs, got, want, strict=True):
        if name in COUPLED:  # auto must not take a per-tensor partition for these
            assert isinstance(tx.layout(params), GatheredLayout), name
        if name in rules:  # a mask or label per parameter: flat with one bucket each
            layout = tx.layout(params)
            assert isinstance(layout, FlatLayout) and layout.by_param, (name, layout)
            # Small parameters share their collectives: what is compared is that path.
            assert len(layout.wire_groups()) == 1, (name, layout.wire_groups())
        assert_tree_close(p, ref_p, rtol=1e-5, atol_rel=1e-5, what=f"parameters of {name}")
        assert_tree_close(s, ref_s, rtol=1e-5, atol_rel=1e-5, what=f"state of {name}")
