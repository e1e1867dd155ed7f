"""Global-norm clipping under zero3_step equals plain Optax on one device (issue 33 item 2).

``optax.chain(clip_by_global_norm(c), optax.adam(...))`` in both spellings (Optax's and
``gradsync_jax``'s) on an MLP and a tiny transformer (attention, LayerNorm, a tied embedding),
at 2, 4 and 8 devices: the clip must be active (the gradient's global norm exceeds ``c`` at
every step, checked on the reference run), and after 5 steps the parameters and Adam's state
(``count``, ``mu``, ``nu``) must equal the one-device run within the floor of
``zero3_problem.py`` (1e-5 relative for parameters, 5e-5 for moments). Before the fix
Optax's clip was refused and gradsync's clipped each device's rows by their own norm.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from gradsync_jax import clip_by_global_norm, param_layout, shard_params, unshard_params, zero3_step
from tests.jax.zero3_problem import RTOL
from tests.support.asserts import assert_close
from tests.support.meshes import dp_mesh
from tests.support.xla import FAST_COMPILE

SLOW = [pytest.mark.slow]  # the fast lane keeps one case: gradsync's clip, the MLP, 2 devices
STEPS = 5
VOCAB, DIM, SEQ = 11, 8, 6


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = jnp.tanh(nn.Dense(11, name="fc1")(x))
        x = jnp.tanh(nn.Dense(13, name="fc2")(x))
        return nn.Dense(3, name="out")(x)


class Block(nn.Module):
    @nn.compact
    def __call__(self, h: jax.Array) -> jax.Array:
        mask = nn.make_causal_mask(jnp.ones(h.shape[:2]))
        # No biases in the attention: a key's bias has a zero gradient (softmax ignores what is
        # added to every key), which Adam turns into rounding noise of the learning rate's size.
        attn = nn.MultiHeadDotProductAttention(
            num_heads=2, qkv_features=DIM, use_bias=False, name="attn"
        )
        h = h + attn(nn.LayerNorm(name="ln1")(h), mask=mask)
        hidden = nn.gelu(nn.Dense(2 * DIM + 3, name="fc")(nn.LayerNorm(name="ln2")(h)))
        return h + nn.Dense(DIM, name="proj")(hidden)


class TinyTransformer(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, DIM, name="embed")
        h = Block(name="block")(embed(tokens))
        return embed.attend(nn.LayerNorm(name="ln_f")(h))


@functools.cache
def mlp_problem() -> tuple[Any, Any, Any, list[str]]:
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(32, 5)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(32, 3)), jnp.float32)
    model = MLP()

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        return jnp.mean((model.apply(params, batch[0]) - batch[1]) ** 2)

    params = jax.jit(model.init, compiler_options=FAST_COMPILE)(jax.random.key(0), x)
    return params, loss_fn, (x, y), ["fc2"]


@functools.cache
def transformer_problem() -> tuple[Any, Any, Any, list[str]]:
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, VOCAB, (16, SEQ + 1)))
    model = TinyTransformer()

    def loss_fn(params: Any, batch: Any) -> jax.Array:
        logits = model.apply(params, batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    params = jax.jit(model.init, compiler_options=FAST_COMPILE)(jax.random.key(0), tokens[:, :-1])
    return params, loss_fn, tokens, ["block"]


PROBLEMS = {"mlp": mlp_problem, "transformer": transformer_problem}
CLIPS = {"optax": optax.clip_by_global_norm, "gradsync": clip_by_global_norm}


@functools.cache
def reference(problem: str, clip: str) -> tuple[Any, Any, float]:
    """One device, the whole batch (jitted, shared by the device counts); ``max_norm`` an
    eighth of the first gradient's norm, and the clip active at every step."""
    params, loss_fn, batch, _ = PROBLEMS[problem]()
    grad_fn = jax.jit(jax.grad(loss_fn), compiler_options=FAST_COMPILE)
    max_norm = float(optax.tree.norm(grad_fn(params, batch))) / 8
    tx = optax.chain(CLIPS[clip](max_norm), optax.adam(1e-2))

    @jax.jit(compiler_options=FAST_COMPILE)
    def step(params: Any, state: Any) -> tuple[Any, Any, jax.Array]:
        grads = jax.grad(loss_fn)(params, batch)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state, optax.tree.norm(grads)

    state = tx.init(params)
    for _ in range(STEPS):
        params, state, norm = step(params, state)
        assert float(norm) > 2 * max_norm  # the clip acts
    return params, state, max_norm


@pytest.mark.parametrize(
    "clip", [pytest.param(c, marks=[] if c == "gradsync" else SLOW) for c in CLIPS]
)
@pytest.mark.parametrize("n", [2, pytest.param(4, marks=SLOW), pytest.param(8, marks=SLOW)])
@pytest.mark.parametrize(
    "problem", [pytest.param(p, marks=[] if p == "mlp" else SLOW) for p in PROBLEMS]
)
def test_global_norm_clip_equals_one_device(problem: str, n: int, clip: str) -> None:
    params, loss_fn, batch, units = PROBLEMS[problem]()
    want_params, want_state, max_norm = reference(problem, clip)
    tx = optax.chain(CLIPS[clip](max_norm), optax.adam(1e-2))
    mesh = dp_mesh(n)
    layout = param_layout(params, world_size=n, units=units)
    step = zero3_step(loss_fn, tx, mesh, layout, compiler_options=FAST_COMPILE)
    sharded = shard_params(params, mesh, layout)
    opt_state = step.init(sharded)
    for _ in range(STEPS):
        sharded, opt_state, _ = step(sharded, opt_state, batch)
    assert_close(unshard_params(sharded, layout), want_params, RTOL["params"], "params")
    assert int(optax.tree.get(opt_state, "count")) == STEPS
    for moment in ("mu", "nu"):
        got = unshard_params(optax.tree.get(opt_state, moment), layout)
        assert_close(got, optax.tree.get(want_state, moment), RTOL["state"], moment)
