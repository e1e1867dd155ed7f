"""Every Optax optimizer is either exact under shard_optimizer or refused: never silently wrong.

The cases are enumerated from ``optax`` and ``optax.contrib`` (every public function that
returns a transformation when called with defaults or with only ``learning_rate=``), so new
Optax optimizers are covered as Optax grows, plus wrappers around transformations that couple
tensors. Each (case, partition) is refused at construction, ``init`` or the first trace, or it
runs 8 steps and must match the same transformation unsharded, parameters and state, at rtol
1e-5. ``auto`` refuses nothing that runs unsharded: what greedy and flat refuse it runs
``gathered``, and those runs are compared too. All accepted cases run in one ``shard_map``
program (one compilation), their states are made by one jitted init, and each case's
unsharded reference is computed once however many partitions ran it.

Cost (issue 26 item 3): refusals are found with ``jax.eval_shape`` (planning, ``init`` and the
first trace, where every refusal happens) instead of compiling an ``init`` per case and
partition (building the cases was 42 % of this file's time, the duplicated references 21 %,
in a profile on the loaded 2-core machine); nothing run or compared is dropped. The sweep
stays at 4 devices: whether a case is refused does not depend on N (the analysis reads the
jaxpr, not sizes, and the 4-device shapes here already split parameters unevenly); the
device-count dependence of the results is what ``test_zero_coupled.py`` checks at 2, 4 and
8 (with ``test_zero_rules.py``'s per-parameter cases). The two large programs (the sharded
step of every accepted run, the unsharded step of every case) compile at LLVM's optimization
level 0 (``FAST_COMPILE``), and the reference is computed in a second thread while the first
plans and traces the sharded runs; the arithmetic compared and the tolerances are unchanged.
Measured on the nearly quiet 2-core machine (load 1.5): 57.9 s -> 54.9 s wall, 69 -> 66 s CPU;
most of what is left is planning and tracing ~330 (case, partition) pairs (GIL-bound) and
XLA's HLO passes on the two programs. Splitting the sharded program into chunks compiled in a
second worker took the wall to 51 s but the CPU to 76 s (worse under pytest-xdist's two
workers), and replaying each build's jaxpr instead of tracing again saved nothing: not kept.
"""

from __future__ import annotations

import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import optax
import optax.contrib
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_jax import shard_optimizer
from gradsync_jax.zero.flat import FlatLayout
from gradsync_jax.zero.gathered import GatheredLayout
from tests.jax.sweep_cases import (
    CASES,
    COUPLED,
    SHAPES,
    STEPS,
    N,
    extra_args_of,
    key_data,
    local_grads,
    loss_value,
    run_reference,
)
from tests.support.asserts import assert_tree_close
from tests.support.meshes import mesh_of
from tests.support.models import random_params
from tests.support.xla import FAST_COMPILE

pytestmark = pytest.mark.slow

PARTITIONS = ("greedy", "flat")


def _partition_of(layout: Any) -> str:
    if isinstance(layout, FlatLayout):
        return "flat"
    return "gathered" if isinstance(layout, GatheredLayout) else "greedy"


def sharded_step(runs: list[tuple[Any, dict]], params: dict, mesh: Any) -> Any:
    specs = tuple(tx.state_specs(params) for tx, _ in runs)

    def body(all_params, states, grads, value):
        grads = jax.tree.map(lambda g: g[0], grads)
        out_p, out_s = [], []
        for (tx, extra), p, s in zip(runs, all_params, states, strict=True):
            updates, s = tx.update(grads, s, p, **{k: value for k in extra})
            out_p.append(optax.apply_updates(p, updates))
            out_s.append(s)
        return tuple(out_p), tuple(out_s)

    return jax.shard_map(
        body, mesh=mesh, in_specs=(P(), specs, P("dp"), P()), out_specs=(P(), specs)
    )


def build(inner: Any, partition: str, extra: dict, mesh: Any, params: dict, grads: dict) -> Any:
    """``shard_optimizer``, ``init`` and the first trace of a step: where refusals happen.

    Abstractly (``eval_shape``): planning and tracing raise every refusal; compiling an
    ``init`` per case would only cost time (the accepted ones are initialized together)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        tx = shard_optimizer(inner, mesh, partition=partition)
        state = jax.eval_shape(tx.init, params)
        step = sharded_step([(tx, extra)], params, mesh)
        jax.eval_shape(step, (params,), (state,), grads, loss_value(0))
    return tx


def sweep(mesh: Any, params: dict, grads0: dict, extras: dict) -> tuple[list, dict]:
    """Every (case, partition): refused with one sentence, or accepted (to run and compare)."""
    accepted, outcomes = [], {}
    for name, inner in CASES.items():
        extra = extras[name]
        for partition in (*PARTITIONS, "auto"):
            if extra is None:  # the unsharded update needs more than value= (a value_fn):
                with pytest.raises(Exception):  # noqa: B017  it must fail loudly too
                    build(inner, partition, {}, mesh, params, grads0)
                outcomes[(name, partition)] = "fails as unsharded does"
                continue
            try:
                tx = build(inner, partition, extra, mesh, params, grads0)
            except ValueError as err:
                message = str(err)
                assert "\n" not in message, f"{name} {partition}: not one sentence: {message}"
                outcomes[(name, partition)] = f"refused: {message}"
                continue
            if partition == "auto":
                chosen = _partition_of(tx.layout(params))
                if chosen == "gathered":  # greedy and flat refused: compare it below
                    accepted.append((name, partition, tx, extra))
                else:
                    assert not outcomes[(name, chosen)].startswith("refused"), (name, chosen)
                outcomes[(name, partition)] = f"runs as {chosen}"
            else:
                accepted.append((name, partition, tx, extra))
                outcomes[(name, partition)] = "matches unsharded"
    return accepted, outcomes


def check_outcomes(outcomes: dict) -> None:
    """Cases that must be accepted, so the sweep cannot pass by refusing everything."""
    for name, partition in [
        ("optax.adam", "flat"),
        ("optax.sgd", "flat"),
        ("optax.lamb", "greedy"),
        ("optax.adafactor", "greedy"),
        ("MultiSteps(lamb, 4)", "greedy"),
        ("MultiSteps(adam, 3)", "flat"),
        ("inject_hyperparams(adamw)(schedule)", "flat"),
        ("adamw(mask by rank)", "flat"),
        ("multi_transform by path(adamw, adam)", "flat"),
        ("multi_transform(adam, set_to_zero) (frozen b)", "flat"),
    ]:
        assert outcomes[(name, partition)] == "matches unsharded", (name, partition)
    for name in ("optax.polyak_sgd", "optax.contrib.dog", "optax.contrib.prodigy"):
        assert outcomes[(name, "greedy")].startswith("refused"), name
    # Coupled optimizers run under auto (gathered), exactly; nothing the unsharded run
    # runs is refused by auto.
    for name in COUPLED:
        assert outcomes[(name, "auto")] == "runs as gathered", (name, outcomes[(name, "auto")])
    refused = [n for (n, p), o in outcomes.items() if p == "auto" and o.startswith("refused")]
    assert not refused, refused


def run_sharded(accepted: list, params: dict, mesh: Any) -> tuple[Any, Any]:
    """All accepted runs, STEPS steps, in one ``shard_map`` program."""
    runs = [(tx, extra) for _, _, tx, extra in accepted]
    step = jax.jit(sharded_step(runs, params, mesh), compiler_options=FAST_COMPILE)
    replicated = NamedSharding(mesh, P())
    all_params = tuple(jax.device_put(params, replicated) for _ in runs)
    init = jax.jit(lambda p: tuple(tx.init(p) for tx, _ in runs), compiler_options=FAST_COMPILE)
    states = init(params)  # one compilation
    for k in range(STEPS):
        grads = jax.device_put(local_grads(k), NamedSharding(mesh, P("dp")))
        all_params, states = step(all_params, states, grads, loss_value(k))
    return all_params, states


def test_every_optax_optimizer_is_exact_or_refused() -> None:
    mesh = mesh_of(N)
    params = random_params(SHAPES)
    grads0 = jax.device_put(local_grads(0), NamedSharding(mesh, P("dp")))
    extras = {name: extra_args_of(inner, params) for name, inner in CASES.items()}
    # Every case the unsharded update runs is accepted under some partition (auto refuses
    # nothing), so the references are known now: computed (mostly compiled, which releases
    # the GIL) in a second thread while this one plans, traces and compiles the sharded runs.
    runnable = [(n, CASES[n], e) for n, e in extras.items() if e is not None]
    with ThreadPoolExecutor(1) as pool:
        reference_run = pool.submit(run_reference, runnable, params)
        accepted, outcomes = sweep(mesh, params, grads0, extras)
        check_outcomes(outcomes)
        all_params, states = run_sharded(accepted, params, mesh)
        references = reference_run.result()
    assert {n for n, _, _, _ in accepted} == {n for n, _, _ in runnable}
    for (name, partition, tx, _), p, s in zip(accepted, all_params, states, strict=True):
        ref_p, ref_s = references[name]
        what = f"{name} partition={partition}"
        assert_tree_close(p, ref_p, rtol=1e-5, atol_rel=1e-5, what=f"parameters of {what}")
        assert_tree_close(
            key_data(tx.gather_state(s, params)),
            key_data(ref_s),
            rtol=1e-5,
            atol_rel=1e-5,
            what=f"state of {what}",
        )
    width = max(len(n) for n in CASES)
    print("\n" + "\n".join(f"{n:{width}s} {p:6s} {o}" for (n, p), o in outcomes.items()))
