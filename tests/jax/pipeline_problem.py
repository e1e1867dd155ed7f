"""The JAX pipeline tests' model (test_pipeline.py, test_pipeline_flax.py): an embedding table,
blocks of LayerNorm and a GELU MLP with a residual, a linear head with cross-entropy, as a
``PipelineModel``; its data, and the unpipelined reference step.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradsync_jax.pipeline import PipelineModel

DIM, HIDDEN, VOCAB, SEQ, ROWS = 8, 16, 11, 3, 2  # ROWS: rows per microbatch
STEPS = 2


def embed(p: Any, tokens: jax.Array) -> jax.Array:
    return p["table"][tokens]


def block(p: Any, x: jax.Array) -> jax.Array:
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    h = (x - mu) * jax.lax.rsqrt(var + 1e-5) * p["scale"] + p["bias"]
    h = jax.nn.gelu(h @ p["w1"] + p["b1"], approximate=False)
    return x + h @ p["w2"] + p["b2"]


def head(p: Any, x: jax.Array, targets: jax.Array) -> jax.Array:
    logits = x @ p["w"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


MODEL = PipelineModel(embed=embed, block=block, head=head)


def init_params(layers: int, seed: int = 0) -> dict[str, Any]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.normal(size=shape) * scale).astype(np.float32)

    blocks = {
        "scale": 1.0 + normal(layers, DIM, scale=0.1),
        "bias": normal(layers, DIM, scale=0.1),
        "w1": normal(layers, DIM, HIDDEN),
        "b1": normal(layers, HIDDEN, scale=0.1),
        "w2": normal(layers, HIDDEN, DIM),
        "b2": normal(layers, DIM, scale=0.1),
    }
    return {
        "embed": {"table": normal(VOCAB, DIM, scale=1.0)},
        "blocks": blocks,
        "head": {"w": normal(DIM, VOCAB)},
    }


def full_loss(params: Any, tokens: jax.Array, targets: jax.Array) -> jax.Array:
    x = embed(params["embed"], tokens)
    x, _ = jax.lax.scan(lambda x, p: (block(p, x), None), x, params["blocks"])
    return head(params["head"], x, targets)


_GRAD = jax.jit(jax.value_and_grad(full_loss))


def make_batch(dp: int, m: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    rows = dp * m * ROWS
    tokens = rng.integers(0, VOCAB, size=(rows, SEQ)).astype(np.int32)
    return tokens, rng.integers(0, VOCAB, size=(rows, SEQ)).astype(np.int32)


def reference(
    natural: Any,
    batches: list[Any],
    plan: Any,
    dp: int,
    tx: optax.GradientTransformation,
    grad_fn: Any = _GRAD,
    state: Any = None,
) -> tuple[Any, Any, list[float]]:
    """The unpipelined steps: per dp replica the microbatches' gradients (``grad_fn(params,
    tokens, targets) -> (loss, grads)``) summed in microbatch order and divided by m, then
    the mean over replicas, then ``tx`` (from ``state``, default ``tx.init``)."""
    m = plan.microbatches
    params = jax.tree.map(jnp.asarray, natural)
    state = tx.init(params) if state is None else state
    losses = []
    for tokens, targets in batches:
        share = tokens.shape[0] // dp
        replica_grads, replica_losses = [], []
        for d in range(dp):
            total = loss_sum = None
            for i in range(m):  # float32 sums on the host: the same IEEE additions, no dispatch
                rows = slice(d * share + i * ROWS, d * share + (i + 1) * ROWS)
                loss, grads = jax.device_get(grad_fn(params, tokens[rows], targets[rows]))
                total = grads if total is None else jax.tree.map(np.add, total, grads)
                loss_sum = loss if loss_sum is None else loss_sum + loss
            replica_grads.append(jax.tree.map(lambda g: g / np.float32(m), total))
            replica_losses.append(loss_sum / np.float32(m))
        grads = jax.tree.map(lambda *g: sum(g[1:], g[0]) / np.float32(dp), *replica_grads)
        updates, state = tx.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        losses.append(float(sum(replica_losses[1:], replica_losses[0]) / dp))
    return params, state, losses
