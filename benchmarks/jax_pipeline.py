"""Pipeline parallelism on 8 CPU devices: gradsync's GPipe / 1F1B / ZB1P against a MaxText-style
pipeline (issue 36 item 5; docs/pipeline.md, "The JAX executor").

The same model (an embedding table, L blocks of LayerNorm + GELU MLP with a residual, a linear
head with cross-entropy), the same mesh (pp x dp = 8), the same Adam and the same batch, m
microbatches per data-parallel replica:

- anchor, MaxText-style (its ``pipeline.py``): the stages are a dimension of the blocks'
  parameters sharded over ``pp``; every iteration each stage runs its blocks on its state and
  the states rotate one stage with ``ppermute``; m + pp - 1 iterations in a ``lax.scan``,
  the backward is JAX's autodiff of that loop, so the order is GPipe's (all forwards, then
  all backwards) and every iteration's residuals are kept;
- gradsync: ``pipeline_step`` on ``plan_pipeline(schedule=...)``, one stage per rank, with
  each stash mode of ``--stash`` (default both: ``GPipe/residuals``, ``GPipe/input``, ...).

All steps run alternating in one process, one step each per round; the figure is the median
step time after warm-up. For each: its ratio to the anchor, the compiled program's temporary
bytes (``memory_analysis()``) and its bubble, measured beside the prediction. Measured: the
step time is a + b * m over the two microbatch counts (b: the steady state's cost per
microbatch), so the bubble at m is a / T(m), the part of the step that more microbatches do
not grow. Predicted: ``simulate_pipeline(plan, forward=1, backward=2, weight=1).bubble``
(the tick grid's idle cells; GPipe's (pp-1)/(m+pp-1) for the anchor). CPU devices share the
host's cores, so an idle device frees a core for the busy ones: on CPU a bubble costs less
than on accelerators, and a is mostly the fixed cost of a step.

    python benchmarks/jax_pipeline.py --quick              # small model, < 5 minutes
    python benchmarks/jax_pipeline.py --repeat 3           # the issue's run
    python benchmarks/jax_pipeline.py --schedules GPipe --stash residuals --microbatches 8
                                                           # one row against the anchor
Last line: one JSON object.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _report import add_repeat_arg, finish, run_repeats
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core import Topology, plan_pipeline, simulate_pipeline
from gradsync_jax import (
    PipelineModel,
    make_local,
    mesh_from_topology,
    pipeline_params,
    pipeline_step,
)
from gradsync_jax.data_parallel import split_microbatches

SCHEDULES = ("GPipe", "1F1B", "ZB1P")
ANCHOR = "anchor (MaxText-style GPipe)"


def embed(p: Any, tokens: jax.Array) -> jax.Array:
    return p["table"][tokens]


def block(p: Any, x: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) * lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    h = jax.nn.gelu(h @ p["w1"] + p["b1"], approximate=False)
    return x + h @ p["w2"] + p["b2"]


def head(p: Any, x: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(x @ p["w"], targets).mean()


MODEL = PipelineModel(embed=embed, block=block, head=head)


def init_params(layers: int, dim: int, hidden: int, vocab: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.normal(size=shape) * scale).astype(np.float32)

    return {
        "embed": {"table": normal(vocab, dim, scale=1.0)},
        "blocks": {
            "scale": np.ones((layers, dim), np.float32),
            "bias": np.zeros((layers, dim), np.float32),
            "w1": normal(layers, dim, hidden, scale=dim**-0.5),
            "b1": np.zeros((layers, hidden), np.float32),
            "w2": normal(layers, hidden, dim, scale=hidden**-0.5),
            "b2": np.zeros((layers, dim), np.float32),
        },
        "head": {"w": normal(dim, vocab, scale=dim**-0.5)},
    }


def anchor_step(mesh: Any, plan: Any, tx: optax.GradientTransformation) -> Any:
    """MaxText's pipeline in one ``shard_map``: the stage dimension sharded over ``pp``, the
    states rotated with ``ppermute`` each iteration, autodiff for the backward (GPipe)."""
    p, m = plan.pp, plan.microbatches
    right = [(i, (i + 1) % p) for i in range(p)]
    axes = ("pp", "dp")

    def loss_fn(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
        me = lax.axis_index("pp")
        blocks = jax.tree.map(lambda leaf: leaf[0, 0], params["blocks"])  # (k, ...)
        table = jax.tree.map(lambda leaf: leaf[0], params["embed"])
        w_head = jax.tree.map(lambda leaf: leaf[0], params["head"])
        # the first stage embeds the microbatches (MaxText embeds before the pipeline)
        inputs = lax.cond(
            me == 0,
            lambda: jax.vmap(lambda t: embed(table, t))(tokens),
            lambda: make_local(jnp.zeros((*tokens.shape, table["table"].shape[1])), axes),
        )

        def stage(x: jax.Array) -> jax.Array:
            x, _ = lax.scan(lambda x, b: (block(b, x), None), x, blocks)
            return x

        def iteration(state: jax.Array, t: jax.Array) -> tuple[jax.Array, jax.Array]:
            x = jnp.where(me == 0, inputs[jnp.minimum(t, m - 1)], state)
            out = stage(x)
            return lax.ppermute(out, "pp", right), out

        zero = make_local(jnp.zeros(inputs.shape[1:], inputs.dtype), axes)
        _, outs = lax.scan(iteration, zero, jnp.arange(m + p - 1))
        final = outs[p - 1 :]  # the last stage's outputs of microbatches 0 .. m-1
        loss = lax.cond(
            me == p - 1,
            lambda: jax.vmap(lambda x, y: head(w_head, x, y))(final, targets).mean(),
            lambda: make_local(jnp.zeros((), jnp.float32), axes),
        )
        return lax.psum(loss, "pp")

    def local(params: Any, opt_state: Any, batch: Any) -> Any:
        tokens, targets = split_microbatches(tuple(batch), m)
        own = make_local(params, axes)
        loss, grads = jax.value_and_grad(loss_fn)(own, tokens, targets)
        grads = {
            "embed": lax.psum(grads["embed"], "pp"),
            "blocks": grads["blocks"],
            "head": lax.psum(grads["head"], "pp"),
        }
        grads = make_local(jax.tree.map(lambda g: lax.pmean(g, "dp"), grads), "pp")
        state = jax.tree.map(lambda leaf: leaf[0], opt_state)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        return params, jax.tree.map(lambda leaf: leaf[None], state), lax.pmean(loss, "dp")

    def specs(tree: Any) -> Any:
        return jax.tree.map(lambda _: P("pp"), tree)

    @jax.jit
    def step(params: Any, opt_state: Any, batch: Any) -> Any:
        named = lambda s: NamedSharding(mesh, s)  # noqa: E731
        params = jax.reshard(params, jax.tree.map(named, specs(params)))
        opt_state = jax.reshard(opt_state, jax.tree.map(named, specs(opt_state)))
        batch = jax.reshard(batch, named(P("dp")))
        return jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(specs(params), specs(opt_state), P("dp")),
            out_specs=(specs(params), specs(opt_state), P()),
        )(params, opt_state, batch)

    return step


def build(args: Any, m: int, natural: Any, mesh: Any, topology: Any) -> dict[str, Any]:
    """name -> (compiled step, params, opt_state, temporary bytes, predicted bubble,
    compile seconds)."""
    tx = optax.adam(1e-3)
    out = {}
    batch = make_batch(args, topology.dp, m)
    for name in (ANCHOR, *variants(args)):
        plan = plan_pipeline(
            schedule="GPipe" if name == ANCHOR else name.split("/")[0],
            microbatches=m,
            topology=topology,
            layers=args.layers,
            stages_per_rank=1,
            input_weight=0,
            output_weight=0,
        )
        params = pipeline_params(natural, plan, mesh)
        if name == ANCHOR:
            step = anchor_step(mesh, plan, tx)
            own = [
                jax.tree.map(lambda leaf, r=r: np.asarray(leaf)[r : r + 1], params)
                for r in range(plan.pp)
            ]
            state = jax.tree.map(lambda *xs: jnp.stack(xs), *[tx.init(p) for p in own])
            lowered = step.lower(params, state, batch)
            bubble = (plan.pp - 1) / (m + plan.pp - 1)
        else:
            pipe = pipeline_step(MODEL, tx, mesh, plan, stash=name.split("/")[1])
            state = pipe.init(params)
            lowered = pipe.lower(params, state, batch)
            step = pipe
            bubble = simulate_pipeline(plan, forward=1, backward=2, weight=1).bubble
        t0 = time.perf_counter()
        compiled = lowered.compile()
        seconds = time.perf_counter() - t0
        temp = compiled.memory_analysis().temp_size_in_bytes
        out[name] = (compiled, params, state, temp, bubble, seconds)
    return out


def variants(args: Any) -> list[str]:
    """``schedule/stash`` for every schedule and stash mode asked for."""
    schedules = args.schedules.split(",")
    return [f"{s}/{stash}" for stash in args.stash.split(",") for s in schedules]


def key_of(name: str) -> str:
    """A variant's prefix in the JSON: ``anchor``, ``gpipe_residuals``, ``onef1b_input``."""
    return name.split(" ")[0].lower().replace("1f1b", "onef1b").replace("/", "_")


def make_batch(args: Any, dp: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    shape = (dp * m * args.rows, args.seq)
    tokens = rng.integers(0, args.vocab, size=shape).astype(np.int32)
    return tokens, rng.integers(0, args.vocab, size=shape).astype(np.int32)


def measure(args: Any, built: dict[int, dict[str, Any]], topology: Any) -> dict[str, Any]:
    figures: dict[str, Any] = {"bench": "jax_pipeline", "pp": topology.pp, "dp": topology.dp}
    medians: dict[int, dict[str, float]] = {}
    for m, steps in built.items():
        batch = make_batch(args, topology.dp, m)
        state = {name: (s[1], s[2]) for name, s in steps.items()}
        times: dict[str, list[float]] = {name: [] for name in steps}
        losses: dict[str, list[float]] = {name: [] for name in steps}
        for r in range(args.warmup + args.rounds):
            for name, (compiled, *_rest) in steps.items():
                params, opt_state = state[name]
                t0 = time.perf_counter()
                params, opt_state, loss = compiled(params, opt_state, batch)
                jax.block_until_ready((params, opt_state, loss))
                if r >= args.warmup:
                    times[name].append(time.perf_counter() - t0)
                if r < 2:
                    losses[name].append(float(loss))
                state[name] = (params, opt_state)
        # the same two first steps: every schedule computes the anchor's losses (the second
        # after an update, so the gradients agree too)
        for name, seen in losses.items():
            if not np.allclose(seen, losses[ANCHOR], rtol=1e-5):
                raise SystemExit(f"{name} losses {seen} differ from the anchor's {losses[ANCHOR]}")
        medians[m] = {name: statistics.median(ts) for name, ts in times.items()}
    ms = sorted(built)
    print(
        f"jax_pipeline: {args.layers} blocks of {args.dim} x {args.hidden}, seq {args.seq}, "
        f"{args.rows} rows per microbatch, vocab {args.vocab}; pp {topology.pp} x dp "
        f"{topology.dp} on 8 CPU devices; Adam; {args.rounds} rounds "
        f"after {args.warmup} warm-up, alternating"
    )
    header = (
        f"{'m':>3} {'variant':<30} {'step (s)':>9} {'vs anchor':>9} {'vs GPipe':>9} "
        f"{'temp MiB':>9} {'bubble':>7} {'predicted':>9} {'compile s':>9}"
    )
    print(header)
    for m in ms:
        anchor = medians[m][ANCHOR]
        for name, (_, _, _, temp, predicted, seconds) in built[m].items():
            t = medians[m][name]
            gpipe = medians[m].get("GPipe/" + name.split("/")[1]) if name != ANCHOR else t
            measured = _measured_bubble(name, m, ms, medians)
            key = key_of(name)
            print(
                f"{m:>3} {name:<30} {t:>9.4f} {t / anchor:>9.3f} "
                f"{_fmt(None if gpipe is None else t / gpipe):>9} "
                f"{temp / 2**20:>9.2f} {_fmt(measured):>7} {predicted:>9.3f} {seconds:>9.1f}"
            )
            figures[f"{key}_m{m}_step_s"] = round(t, 5)
            figures[f"{key}_m{m}_temp_bytes"] = temp
            figures[f"{key}_m{m}_bubble_predicted"] = round(predicted, 4)
            if measured is not None:
                figures[f"{key}_m{m}_bubble_measured"] = round(measured, 4)
            if name != ANCHOR:
                figures[f"{key}_m{m}_ratio_vs_anchor"] = round(t / anchor, 4)
                if gpipe is not None:
                    figures[f"{key}_m{m}_vs_gpipe"] = round(t / gpipe, 4)
    return figures


def _measured_bubble(
    name: str, m: int, ms: list[int], medians: dict[int, dict[str, float]]
) -> float | None:
    """a / T(m) from the line T = a + b * m through the first and last microbatch counts."""
    if len(ms) < 2:
        return None
    lo, hi = ms[0], ms[-1]
    slope = (medians[hi][name] - medians[lo][name]) / (hi - lo)
    return 1.0 - slope * m / medians[m][name]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a small model, fewer rounds")
    parser.add_argument("--pp", type=int, default=4)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--dim", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=None)
    parser.add_argument("--seq", type=int, default=None)
    parser.add_argument("--rows", type=int, default=4, help="rows per microbatch")
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--microbatches", default=None, help="comma list, default 2pp,4pp")
    parser.add_argument(
        "--stash", default="residuals,input", help="comma list of stash modes (residuals, input)"
    )
    parser.add_argument(
        "--schedules", default=",".join(SCHEDULES), help="comma list of gradsync's schedules"
    )
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=2)
    add_repeat_arg(parser)
    args = parser.parse_args()
    small = args.quick
    args.layers = args.layers or (8 if small else 16)
    args.dim = args.dim or (128 if small else 256)
    args.hidden = args.hidden or 4 * args.dim
    args.seq = args.seq or (32 if small else 64)
    args.rounds = args.rounds or (5 if small else 15)
    ms = (
        [int(x) for x in args.microbatches.split(",")]
        if args.microbatches
        else [2 * args.pp, 4 * args.pp]
    )
    topology = Topology.create(8, pp=args.pp)
    mesh = mesh_from_topology(topology)
    natural = init_params(args.layers, args.dim, args.hidden, args.vocab)
    built = {m: build(args, m, natural, mesh, topology) for m in ms}
    runs = run_repeats(lambda _: measure(args, built, topology), args.repeat)
    keys = [f"{key_of(name)}_m{m}_ratio_vs_anchor" for m in ms for name in variants(args)]
    finish(runs, keys)


if __name__ == "__main__":
    main()
