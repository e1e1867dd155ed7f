"""The GPT of ``pipeline_models.py`` in Flax NNX, for the JAX pipeline executor (docs/pipeline.md).

The same modules under the same attribute names (``token``, ``qkv``, ``fc_out``, ...) and the
same arithmetic as torch's (LayerNorm with torch's epsilon and two-pass variance, exact GELU,
attention written out), so the naming rules of ``gradsync_jax`` (``to_torch_state``) give
torch's names and layouts. The pipeline runs it as an embedding, ONE block whose parameters
are stacked on a leading layer dimension (made under ``nnx.vmap``) and a head:
``nnx_model(gpt.embed, gpt.blocks, gpt.head, lm_loss)``. Its parameters, turned into the
numbered model ``sequential_params`` names (``0`` the embedding, ``1`` .. ``L`` the blocks,
``L + 1`` the head), are torch's ``gpt_blocks()``'s: weights copy both ways and a pipeline
checkpoint of either executor continues in the other (tests/parity/test_cross_pipeline.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

EPS = 1e-5  # torch's LayerNorm epsilon


def _norm(width: int, rngs: nnx.Rngs) -> nnx.LayerNorm:
    return nnx.LayerNorm(width, epsilon=EPS, use_fast_variance=False, rngs=rngs)


class Embedding(nnx.Module):
    """Token and position embeddings, summed."""

    def __init__(self, vocab: int, seq: int, width: int, *, rngs: nnx.Rngs) -> None:
        self.token = nnx.Embed(vocab, width, rngs=rngs)
        self.position = nnx.Embed(seq, width, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        return self.token(tokens) + self.position(jnp.arange(tokens.shape[1]))


class Layer(nnx.Module):
    """A pre-LayerNorm decoder layer: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int, *, rngs: nnx.Rngs) -> None:
        self.heads = heads
        self.ln_attn = _norm(width, rngs)
        self.qkv = nnx.Linear(width, 3 * width, rngs=rngs)
        self.proj = nnx.Linear(width, width, rngs=rngs)
        self.ln_mlp = _norm(width, rngs)
        self.fc_in = nnx.Linear(width, 4 * width, rngs=rngs)
        self.fc_out = nnx.Linear(4 * width, width, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        b, t, d = x.shape
        h = self.heads
        q, k, v = jnp.split(self.qkv(self.ln_attn(x)), 3, axis=-1)
        q, k, v = (z.reshape(b, t, h, d // h).transpose(0, 2, 1, 3) for z in (q, k, v))
        scores = q @ k.swapaxes(-2, -1) / (d // h) ** 0.5
        mask = jnp.triu(jnp.ones((t, t), dtype=bool), 1)
        attn = jax.nn.softmax(jnp.where(mask, -jnp.inf, scores), axis=-1) @ v
        x = x + self.proj(attn.transpose(0, 2, 1, 3).reshape(b, t, d))
        return x + self.fc_out(jax.nn.gelu(self.fc_in(self.ln_mlp(x)), approximate=False))


class Head(nnx.Module):
    """The final LayerNorm and the output layer (logits)."""

    def __init__(self, width: int, vocab: int, *, rngs: nnx.Rngs) -> None:
        self.ln = _norm(width, rngs)
        self.out = nnx.Linear(width, vocab, use_bias=False, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.out(self.ln(x))


class GPT(nnx.Module):
    """``embed``, ``blocks`` (one ``Layer``, every parameter stacked: ``(layers, ...)``) and
    ``head``; ``__call__`` runs the blocks in turn with ``nnx.scan`` (the unpipelined model)."""

    def __init__(
        self,
        layers: int = 8,
        width: int = 16,
        heads: int = 2,
        vocab: int = 32,
        seq: int = 8,
        *,
        rngs: nnx.Rngs,
    ) -> None:
        self.embed = Embedding(vocab, seq, width, rngs=rngs)

        @nnx.split_rngs(splits=layers)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def stack(rngs: nnx.Rngs) -> Layer:
            return Layer(width, heads, rngs=rngs)

        self.blocks = stack(rngs)
        self.head = Head(width, vocab, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: Layer, x: jax.Array) -> jax.Array:
            return block(x)

        return self.head(run(self.blocks, self.embed(tokens)))


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Next-token cross-entropy, the mean over the microbatch's tokens."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
