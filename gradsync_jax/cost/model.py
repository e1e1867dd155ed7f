"""The model profile of a JAX model: each block's jitted forward and backward, timed alone.

A model is given as its blocks in order, each ``(prefix, apply, params)`` with
``apply(params, x) -> y``; the loss closes the last one. Each block's forward is one jitted
program, its backward another (``jax.vjp`` with respect to its parameters and its input, at
the cotangent the next block hands back), timed in turn on the block's real input. With a
``mesh`` every program runs in ``jax.shard_map`` over its devices, the batch split over
``axis_name`` and the parameters replicated, so the time is a device's while all of them
compute at once, as in a data-parallel step. What the forward saves for the backward is the
residuals ``jax.vjp`` keeps (less the parameters and the input themselves); the optimizer's
time is one jitted ``update`` and ``apply_updates`` of every parameter, and its scratch is
what XLA allocates for it beyond its arguments (``memory_analysis``). ``ModelProfiler`` keeps
the compiled programs, to take the profile again without compiling (between a benchmark's
rounds).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from gradsync_core.plan import BlockTime, ModelProfile, median_profile

Block = tuple[str, Callable[[Any, Any], Any], Any]


def _nbytes(tree: Any) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree))


def _timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    return time.perf_counter() - start, out


def profile_model(
    blocks: Sequence[Block],
    x: Any,
    loss_fn: Callable[[Any], jax.Array],
    *,
    samples: int,
    mesh: Mesh | None = None,
    axis_name: str = "dp",
    tx: optax.GradientTransformation | None = None,
    steps: int = 5,
    warmup: int = 2,
) -> ModelProfile:
    """Time each block's forward and backward, and the optimizer, on this process's devices.

    Args:
        blocks: ``(prefix, apply, params)`` in forward order; ``prefix`` is the block's module
            path as the plan names its parameters (``layers.0``).
        x: the first block's input (the whole batch; with ``mesh``, split over ``axis_name``).
        loss_fn: the loss of the last block's output (its time counts in the last block).
        samples: samples per device and microbatch (``x``'s rows over the mesh's devices).
        mesh: run every program on all its devices at once (default: one device).
        axis_name: the mesh axis the batch is split over.
        tx: the optimizer: time its update of every block's parameters (the profile's
            ``optimizer_s`` and ``optimizer_bytes``).
        steps: timed runs of every program (each block's median counts).
        warmup: untimed runs first (the first compiles).

    Returns:
        The ``"measured"`` profile.

    Raises:
        ValueError: no blocks, or ``steps < 1``.
    """
    profiler = ModelProfiler(
        blocks, x, loss_fn, samples=samples, mesh=mesh, axis_name=axis_name, tx=tx
    )
    return profiler.run(steps=steps, warmup=warmup)


class ModelProfiler:
    """``profile_model``'s programs, compiled once, so a profile can be taken again and again
    (between a benchmark's timed rounds, seeing the load its steps see) without compiling
    anew: ``run(steps=1, warmup=0)`` costs a step's worth of programs.

    Args: as ``profile_model``'s.

    Raises:
        ValueError: no blocks.
    """

    def __init__(
        self,
        blocks: Sequence[Block],
        x: Any,
        loss_fn: Callable[[Any], jax.Array],
        *,
        samples: int,
        mesh: Mesh | None = None,
        axis_name: str = "dp",
        tx: optax.GradientTransformation | None = None,
    ) -> None:
        if not blocks:
            raise ValueError("profile_model needs at least one block")
        self.blocks, self.samples, self.mesh = list(blocks), samples, mesh

        def mapped(fn: Callable[..., Any], specs: tuple[Any, ...], out: Any) -> Callable[..., Any]:
            if mesh is None:
                return jax.jit(fn)
            return jax.jit(
                jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=out, check_vma=False)
            )

        data = P(axis_name) if mesh is not None else None
        self.forwards, self.backwards = [], []
        for _, apply, _ in blocks:
            self.forwards.append(mapped(apply, (P(), data), data))

            def backward(params: Any, inp: Any, cotangent: Any, apply: Any = apply) -> Any:
                return jax.vjp(apply, params, inp)[1](cotangent)

            self.backwards.append(mapped(backward, (P(), data, data), (P(), data)))

        def loss_grad(y: Any) -> Any:
            return jax.value_and_grad(loss_fn)(y)

        self.loss_step = mapped(loss_grad, (data,), (P(), data))
        params = [p for _, _, p in blocks]
        if mesh is not None:  # the inputs as shard_map's in_specs say (axes may be Explicit)
            x = jax.device_put(x, NamedSharding(mesh, P(axis_name)))
            params = [jax.device_put(p, NamedSharding(mesh, P())) for p in params]
        self.x, self.params = x, params

        def whole(ps: list[Any], inp: Any) -> jax.Array:
            for (_, apply, _), p in zip(blocks, ps, strict=True):
                inp = apply(p, inp)
            return loss_fn(inp)

        self.forward = mapped(whole, (P(), data), P())
        self.both = mapped(
            lambda ps, inp: jax.value_and_grad(whole)(ps, inp), (P(), data), (P(), P())
        )
        self.train: Callable[..., Any] | None = None
        self.optimizer_bytes: int | None = None
        if tx is not None:
            state = tx.init(params)
            if mesh is not None:
                state = jax.device_put(state, NamedSharding(mesh, P()))

            def train(ps: list[Any], st: Any, inp: Any) -> Any:
                updates, st = tx.update(jax.grad(whole)(ps, inp), st, ps)
                return optax.apply_updates(ps, updates), st

            self.train, self.state = mapped(train, (P(), P(), data), (P(), P())), state
            stats = jax.jit(train).lower(params, state, x).compile().memory_analysis()
            grads = jax.jit(jax.grad(whole)).lower(params, x).compile().memory_analysis()
            if stats is not None and grads is not None:  # XLA's analysis, where it has one
                self.optimizer_bytes = max(
                    0, int(stats.temp_size_in_bytes - grads.temp_size_in_bytes)
                )
        devices = 1 if mesh is None else mesh.devices.size
        self.saved, self.outputs = _activations(blocks, x, devices)
        self.saved = _held(self.saved, whole, [p for _, _, p in blocks], x, devices)
        self.note = f"gradsync_jax.profile_model: jax {jax.__version__}, {devices} device(s)"
        self._compiled = False

    def run(self, steps: int = 5, warmup: int = 2) -> ModelProfile:
        """Time every program ``steps`` times after ``warmup`` untimed runs (the first run of
        this profiler compiles, untimed, whatever ``warmup`` says).

        Raises:
            ValueError: ``steps < 1``.
        """
        if not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        if not self._compiled:
            warmup = max(warmup, 1)
        runs = []
        for step in range(warmup + steps):
            inputs, forward_s = [self.x], []
            for fn, p in zip(self.forwards, self.params, strict=True):
                seconds, y = _timed(fn, p, inputs[-1])
                forward_s.append(seconds)
                inputs.append(y)
            loss_s, (_, cotangent) = _timed(self.loss_step, inputs[-1])
            backward_s = [0.0] * len(self.blocks)
            for i in reversed(range(len(self.blocks))):
                backward_s[i], (_, cotangent) = _timed(
                    self.backwards[i], self.params[i], inputs[i], cotangent
                )
            forward_s[-1] += loss_s
            if step >= warmup:
                runs.append(
                    ModelProfile(
                        blocks=tuple(
                            BlockTime(prefix=prefix, forward_s=f, backward_s=b, output_bytes=0)
                            for (prefix, _, _), f, b in zip(
                                self.blocks, forward_s, backward_s, strict=True
                            )
                        ),
                        samples=self.samples,
                        source="measured",
                    )
                )
        merged = self._fused_totals(median_profile(runs), steps)
        self._compiled = True
        return replace(
            merged,
            blocks=tuple(
                replace(b, activation_bytes=a, output_bytes=o)
                for b, a, o in zip(merged.blocks, self.saved, self.outputs, strict=True)
            ),
            note=f"{self.note}, {steps} runs",
        )

    def _fused_totals(self, profile: ModelProfile, steps: int) -> ModelProfile:
        """``profile`` with its forward and backward totals those of the whole model in one
        program each (a step is one program, without a call per block), split over the blocks
        as their own programs measured them; with an optimizer, its time is what it adds to
        that program (XLA fuses the update into the step, so a program of its own would
        mislead)."""
        params, x = self.params, self.x
        if not self._compiled:
            jax.block_until_ready(self.forward(params, x))
            jax.block_until_ready(self.both(params, x))
        forward_s = statistics.median(_timed(self.forward, params, x)[0] for _ in range(steps))
        both_s = statistics.median(_timed(self.both, params, x)[0] for _ in range(steps))
        backward_s = max(0.0, both_s - forward_s)
        f = forward_s / profile.forward_s if profile.forward_s else 1.0
        # A model so small that its gradient costs less than the noise keeps its blocks' times.
        b = backward_s / profile.backward_s if backward_s > 0 and profile.backward_s else 1.0
        if self.train is not None:
            if not self._compiled:
                jax.block_until_ready(self.train(params, self.state, x))
            step_s = statistics.median(
                _timed(self.train, params, self.state, x)[0] for _ in range(steps)
            )
            profile = replace(
                profile,
                optimizer_s=max(0.0, step_s - both_s),
                optimizer_bytes=self.optimizer_bytes,
            )
        return replace(
            profile,
            blocks=tuple(
                replace(block, forward_s=block.forward_s * f, backward_s=block.backward_s * b)
                for block in profile.blocks
            ),
        )


def _held(
    saved: list[int], whole: Callable[..., Any], params: list[Any], x: Any, devices: int
) -> list[int]:
    """``saved`` (each block's ``jax.vjp`` residuals) scaled to what a compiled step holds.

    XLA fuses a block's elementwise chain and recomputes what is cheap inside its fusions, so
    a step keeps fewer bytes between the forward and the backward than ``jax.vjp`` lists (8
    blocks of ``gelu(x @ w.T + b)``, 8 rows of 512: 1.38 MiB of residuals, 0.36 MiB held).
    What it holds is the temporary bytes of the whole model's gradient program compiled for
    one device's batch (``memory_analysis``: beside the parameters and gradients, which are
    its arguments and outputs); split over the blocks as their residuals. Unchanged where
    XLA gives no analysis.
    """
    total = sum(saved)
    local = jax.ShapeDtypeStruct((x.shape[0] // devices, *x.shape[1:]), x.dtype)
    stats = jax.jit(jax.grad(whole)).lower(params, local).compile().memory_analysis()
    if stats is None or not total:
        return saved
    return [s * int(stats.temp_size_in_bytes) // total for s in saved]


def _activations(blocks: Sequence[Block], x: Any, devices: int) -> tuple[list[int], list[int]]:
    """Per device: each block's residuals (what ``jax.vjp`` keeps, less its parameters and
    input) and output, from shapes alone."""
    saved, outputs = [], []
    inp = jax.eval_shape(lambda a: a, x)
    for _, apply, params in blocks:
        y, vjp = jax.vjp(apply, params, jnp.zeros(inp.shape, inp.dtype))
        kept = {id(leaf) for leaf in jax.tree_util.tree_leaves(params)}
        residuals = [r for r in jax.tree_util.tree_leaves(vjp) if id(r) not in kept]
        total = sum(int(r.size) * r.dtype.itemsize for r in residuals)
        saved.append(max(0, total - _nbytes(inp)) // devices)
        outputs.append(_nbytes(y) // devices)
        inp = jax.eval_shape(lambda a: a, y)
    return saved, outputs
