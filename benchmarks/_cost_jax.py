"""The JAX side of ``cost_model.py``: calibrate 8 CPU devices, profile, run, measure.

Run by ``cost_model.py`` in a process of its own (JAX's 8 devices are set before it is
imported; torch is never imported here). Reads its arguments as one JSON object on the
command line, prints the rows as one JSON line. Every configuration is built from the plans
``gradsync_core.plan.predict`` made: ``synced(plan=...)`` takes the bucket plan itself, and the
ZeRO plans are compared by fingerprint. A step's time is the median of the jitted step's wall
time (the step is one program on all devices); its peak is XLA's for one device of the compiled
step (``memory_analysis``: arguments + outputs + temporaries - aliased), jitted with the
parameters and optimizer state donated, as a training loop runs it (undonated, XLA holds the
old and the new state at once: twice the state, which no plan's peak counts). The model profile is
taken once before the configurations are built (for the plans) and then once in every timed
round, before its steps (``ModelProfiler``: the programs compiled once), so it sees the load
the steps see; the prediction uses the median over the rounds.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from gradsync_core import Topology
from gradsync_core.plan import Configuration, MachineProfile, median_profile, predict
from gradsync_jax import (
    data_parallel_step,
    mesh_from_topology,
    param_layout,
    param_specs,
    shard_optimizer,
    shard_params,
    synced,
    zero3_step,
)
from gradsync_jax.cost.machine import calibrate
from gradsync_jax.cost.model import ModelProfiler

LR = 1e-3
CONFIGS = [
    Configuration(bucket_cap_mb=1, overlap=False),
    Configuration(bucket_cap_mb=25, overlap=False),
    Configuration(zero=2, bucket_cap_mb=25, overlap=False, param_sync="all_gather"),
    Configuration(zero=3, overlap=False),
    Configuration(zero=3, overlap=False, reshard_after_forward=False),
    Configuration(zero=3, overlap=False, dp_shard=4),
]


def build(layers: int, width: int) -> dict[str, jax.Array]:
    """The torch model's twin: ``layers.i.fc.weight`` (out, in) and ``.bias``, flat names."""
    key = jax.random.key(0)
    params = {}
    for i in range(layers):
        key, sub = jax.random.split(key)
        bound = 1 / np.sqrt(width)
        params[f"layers.{i}.fc.weight"] = jax.random.uniform(
            sub, (width, width), minval=-bound, maxval=bound
        )
        params[f"layers.{i}.fc.bias"] = jnp.zeros((width,))
    return params


def block(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    return jax.nn.gelu(x @ w.T + b, approximate=False)


def make_loss(layers: int) -> Any:
    def loss_fn(params: Any, x: Any) -> jax.Array:
        for i in range(layers):
            x = block(x, params[f"layers.{i}.fc.weight"], params[f"layers.{i}.fc.bias"])
        return jnp.mean(jnp.square(x))

    return loss_fn


def profiler(args: dict[str, Any], params: Any, x: Any, mesh: Any) -> ModelProfiler:
    """The model's profiler: its programs compiled once, run again between the rounds."""
    blocks = [
        (
            f"layers.{i}",
            lambda p, h: block(h, p["w"], p["b"]),
            {"w": params[f"layers.{i}.fc.weight"], "b": params[f"layers.{i}.fc.bias"]},
        )
        for i in range(args["layers"])
    ]
    return ModelProfiler(
        blocks,
        x,
        lambda y: jnp.mean(jnp.square(y)),
        samples=x.shape[0] // mesh.devices.size,
        mesh=mesh,
        tx=optax.adam(LR),
    )


def runner(
    config: Configuration, prediction: Any, params: Any, args: dict[str, Any]
) -> tuple[Any, bool]:
    """``(step, state, batch)`` of one configuration and whether its plan is the predicted."""
    loss_fn = make_loss(args["layers"])
    topology: Topology = prediction.topology
    mesh = mesh_from_topology(topology)
    x = jnp.asarray(
        np.random.default_rng(1).normal(size=(args["global_batch"], args["width"])), jnp.float32
    )
    if config.zero == 3:
        layout = param_layout(
            params,
            world_size=topology.dp,
            units=[f"layers.{i}" for i in range(args["layers"])],
            dp_shard=topology.dp_shard,
        )
        step = zero3_step(
            loss_fn,
            optax.adam(LR),
            mesh,
            layout,
            reshard_after_forward=config.reshard_after_forward,
        )
        sharded = shard_params(params, mesh, layout)
        match = layout.plan.fingerprint == prediction.param_shards.fingerprint
        return (step, sharded, step.init(sharded), x), match
    if config.zero == 2:
        tx = shard_optimizer(
            optax.adam(LR), mesh, partition="flat", bucket_cap_mb=config.bucket_cap_mb
        )
        match = tx.plan(params).fingerprint == prediction.shards.fingerprint
    else:
        tx = optax.chain(synced("dp", plan=prediction.buckets), optax.adam(LR))
        match = True
    step = data_parallel_step(loss_fn, tx, mesh)
    return (step, params, tx.init(params), x), match


def peak_bytes(step: Any, state: tuple[Any, ...]) -> int:
    stats = (
        jax.jit(lambda p, s, b: step(p, s, b), donate_argnums=(0, 1))
        .lower(*state)
        .compile()
        .memory_analysis()
    )
    total = stats.argument_size_in_bytes + stats.output_size_in_bytes + stats.temp_size_in_bytes
    return int(total - stats.alias_size_in_bytes)


def main() -> None:
    args = json.loads(sys.argv[1])
    start = time.perf_counter()
    if "machine" in args:  # a profile calibrated before (a rerun of the measurement only)
        machine = MachineProfile.from_json(args["machine"])
    else:
        machine = calibrate(name="jax cpu x8")
    calibrate_s = time.perf_counter() - start
    if "save_machine" in args:
        with open(args["save_machine"], "w") as f:
            json.dump(machine.to_json(), f)
    params = build(args["layers"], args["width"])
    # The executors' order: modules by index, a weight before its bias (torch's registration
    # order, which ZeRO's layouts follow), not the tree's sorted keys.
    by_name = {s.name: s for s in param_specs(params)}
    specs = [
        by_name[f"layers.{i}.fc.{k}"] for i in range(args["layers"]) for k in ("weight", "bias")
    ]
    mesh = mesh_from_topology(Topology.create(8))
    x = jnp.ones((args["global_batch"], args["width"]), jnp.float32)
    model_profiler = profiler(args, params, x, mesh)
    first = model_profiler.run(steps=args["profile_steps"])
    runners, matches, peaks, predictions = [], [], [], []
    only = [part.strip() for part in (args.get("only") or "").split(",") if part.strip()]
    configs = [c for c in CONFIGS if not only or any(part in c.describe() for part in only)]
    for config in configs:
        p = predict(
            specs,
            config,
            world_size=8,
            machine=machine,
            model=first,
            global_batch=args["global_batch"],
            executor="jax",
        )
        (step, *state), match = runner(config, p, params, args)
        peaks.append(peak_bytes(step, tuple(state)))
        runners.append([step, *state])
        matches.append(match)
    times: list[list[float]] = [[] for _ in runners]
    rounds = []
    for r in range(args["warmup"] + args["steps"]):
        if r >= args["warmup"]:  # the profile between the rounds: it sees the steps' load
            rounds.append(model_profiler.run(steps=1, warmup=0))
        # the configurations in a turning order, as the torch part runs them: none always
        # follows the same one (whose buffers malloc and the caches still hold)
        for k in range(len(runners)):
            i = (k + r) % len(runners)
            step, p, s, b = runners[i]
            t0 = time.perf_counter()
            p, s, loss = step(p, s, b)
            jax.block_until_ready(loss)
            if r >= args["warmup"]:
                times[i].append(time.perf_counter() - t0)
            runners[i] = [step, p, s, b]
    model = median_profile(rounds)
    model = type(model)(
        **{
            **{f: getattr(model, f) for f in model.__dataclass_fields__},
            "optimizer_bytes": first.optimizer_bytes,
        }
    )
    for config in configs:
        predictions.append(
            predict(
                specs,
                config,
                world_size=8,
                machine=machine,
                model=model,
                global_batch=args["global_batch"],
                executor="jax",
            )
        )
    rows = [
        {
            "framework": "jax x8",
            "label": p.configuration.describe(),
            "configuration": p.configuration.to_json(),
            "predicted_step_s": p.step_s,
            "standalone_step_s": p.step_s,
            "predicted_compute_s": p.cost.compute_s,
            "predicted_exposed_s": p.cost.exposed_comm_s,
            "predicted_peak_bytes": p.peak_bytes,
            "compute_only_s": model.forward_s + model.backward_s + model.optimizer_s,
            "step_s": statistics.median(t),
            "peak_bytes": peak,
            "plan_match": match,
            "calibrate_s": calibrate_s,
            "inputs": {"machine": machine.to_json(), "model": model.to_json()},
        }
        for p, t, peak, match in zip(predictions, times, peaks, matches, strict=True)
    ]
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
