"""The Flax side of the tied-embedding, frozen-layer twin (tests/parity/tied_worker.py's
``TiedLM``): ``TiedLinen`` has one table and calls ``Embed.attend``; the frozen layer is kept
out of the tree given to the optimizer (``split`` / ``joined``). Shared by
test_cross_tied.py, test_cross_param_shards.py, tests/jax/test_orbax_interchange.py and
tests/torch/test_fully_shard_checkpoint.py.
"""

from __future__ import annotations

import flax.linen as fnn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradsync_jax import data_parallel_step
from tests.parity.tied_worker import DEPTH, DIM, VOCAB

RENAMES = {f"layers_{i}": f"layers.{i}" for i in range(DEPTH)}
BATCH = 24


class TiedLinen(fnn.Module):
    @fnn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = fnn.Embed(VOCAB, DIM, name="embed")
        h = jnp.tanh(fnn.Dense(DIM, name="frozen")(embed(tokens)))
        for i in range(DEPTH):
            h = jnp.tanh(fnn.Dense(DIM, name=f"layers_{i}")(h))
        return embed.attend(h)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.integers(0, VOCAB, BATCH), rng.integers(0, VOCAB, BATCH)


def split(variables):
    """(trainable tree for the optimizer, frozen layer's params)."""
    params = dict(variables["params"])
    frozen = params.pop("frozen")
    return {"params": params}, frozen


def train_jax(tx, trainable, frozen, opt_state, steps: int):
    model = TiedLinen()

    def loss_fn(p, batch):
        logits = model.apply({"params": {**p["params"], "frozen": frozen}}, batch[0])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    step = data_parallel_step(loss_fn, tx, tx.mesh)
    batch = tuple(jnp.asarray(a) for a in data())
    for _ in range(steps):
        trainable, opt_state, _ = step(trainable, opt_state, batch)
    return trainable, opt_state


def joined(trainable, frozen):
    return {"params": {**trainable["params"], "frozen": frozen}}


def adamw() -> optax.GradientTransformation:
    return optax.adamw(1e-2, b1=0.5, b2=0.75, eps=1e-8, weight_decay=0.1)


def linen_init():
    return TiedLinen().init(jax.random.key(3), jnp.zeros((1,), jnp.int32))


def random_variables():
    """TiedLinen's variables, random values of the shapes ``init`` makes, without compiling
    ``init`` (for tests that overwrite every value by a load before comparing)."""
    shapes = jax.eval_shape(lambda: TiedLinen().init(jax.random.key(3), np.zeros(1, np.int32)))
    rng = np.random.default_rng(3)
    return jax.tree_util.tree_map(lambda s: rng.standard_normal(s.shape).astype(s.dtype), shapes)
