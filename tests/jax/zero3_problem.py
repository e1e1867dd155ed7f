"""The ZeRO-3 tests' problem (test_param_sharding*.py, the multi-process checkpoint and the
swapped-files tests): a tied, partly frozen Flax model with every dim-0 case the plan cuts (in
torch's layout), its data, and its unsharded single-device reference.

The tied embedding has 6 rows (fewer than 8 devices), the frozen layer 3, ``layers_0`` 11
(uneven at every size) and ``layers_1`` 5. ``RTOL``: the same-framework floor of
tests/parity/test_cross_checkpoint.py (1e-5 relative for parameters, 5e-5 for moments: 4x what
the order of a gradient sum alone moves them).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from gradsync_jax import param_layout, shard_params, zero3_step
from tests.support.meshes import dp_mesh

VOCAB, DIM, BATCH, STEPS = 6, 5, 24, 8
RTOL = {"params": 1e-5, "state": 5e-5}
FROZEN = ["frozen"]
UNITS = ["layers_0", "layers_1"]


class Tied(nn.Module):
    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        embed = nn.Embed(VOCAB, DIM, name="embed")
        h = jnp.tanh(nn.Dense(3, name="frozen")(embed(tokens)))
        h = jnp.tanh(nn.Dense(11, name="layers_0")(h))
        h = jnp.tanh(nn.Dense(DIM, name="layers_1")(h))
        return embed.attend(h)


MODEL = Tied()


def data() -> tuple[jax.Array, jax.Array]:
    rng = np.random.default_rng(1)
    return jnp.asarray(rng.integers(0, VOCAB, BATCH)), jnp.asarray(rng.integers(0, VOCAB, BATCH))


def loss_fn(params, batch):
    logits = MODEL.apply(params, batch[0])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()


def adamw() -> optax.GradientTransformation:
    return optax.adamw(1e-2, b1=0.5, b2=0.75, eps=1e-8, weight_decay=0.1)


def init_params():
    return MODEL.init(jax.random.key(0), data()[0])


def reference(tx, params, steps: int = STEPS):
    """One device, the whole batch; the frozen layer outside the optimizer's tree."""
    frozen = params["params"]["frozen"]
    trainable = {"params": {k: v for k, v in params["params"].items() if k != "frozen"}}

    def joined(t):
        return {"params": {**t["params"], "frozen": frozen}}

    state = tx.init(trainable)
    batch = data()
    for _ in range(steps):
        grads = jax.grad(lambda t: loss_fn(joined(t), batch))(trainable)
        updates, state = tx.update(grads, state, trainable)
        trainable = optax.apply_updates(trainable, updates)
    return joined(trainable), state


def train(tx, n: int, *, reshard: bool = True, steps: int = STEPS):
    params = init_params()
    layout = param_layout(params, world_size=n, units=UNITS, frozen=FROZEN)
    mesh = dp_mesh(n)
    sharded = shard_params(params, mesh, layout)
    step = zero3_step(loss_fn, tx, mesh, layout, reshard_after_forward=reshard)
    opt_state = step.init(sharded)
    batch = data()
    for _ in range(steps):
        sharded, opt_state, loss = step(sharded, opt_state, batch)
    return layout, sharded, opt_state, loss


def without_frozen(tree):
    return {"params": {k: v for k, v in tree["params"].items() if k != "frozen"}}
