"""Reference models for the JAX tests: a serial MLP transformer and its tensor-parallel twin.

The parallel model has the same parameter tree as the serial one, so
``nnx.update(parallel, nnx.state(serial))`` copies a serial model in, and the tests compare
the two (docs/design.md §6).
"""

from __future__ import annotations

import jax
from flax import nnx

from gradsync_jax import ColumnParallelLinear, RowParallelLinear


class MLPBlock(nnx.Module):
    """Serial reference block: ``x + fc2(gelu(fc1(ln(x))))`` (a transformer block, no attention)."""

    def __init__(self, dim: int, hidden: int, *, rngs: nnx.Rngs) -> None:
        self.ln = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = nnx.Linear(dim, hidden, rngs=rngs)
        self.fc2 = nnx.Linear(hidden, dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(nnx.gelu(self.fc1(self.ln(x)), approximate=False))


class MLPTransformer(nnx.Module):
    """Serial reference: ``depth`` ``MLPBlock``s and a final ``LayerNorm``, on (batch, seq, dim)."""

    def __init__(self, dim: int, hidden: int, depth: int, *, rngs: nnx.Rngs) -> None:
        self.blocks = nnx.List([MLPBlock(dim, hidden, rngs=rngs) for _ in range(depth)])
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)


class ParallelMLPBlock(nnx.Module):
    """``MLPBlock`` with fc1 column- and fc2 row-parallel on ``axis``; same parameter tree.

    The LayerNorm is Flax's own: on a sequence chunk (cp, sequence parallelism) it normalizes
    token by token exactly as the serial one does.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        *,
        axis: str = "tp",
        sequence_parallel: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        kw = {"axis": axis, "sequence_parallel": sequence_parallel, "rngs": rngs}
        self.ln = nnx.LayerNorm(dim, rngs=rngs)
        self.fc1 = ColumnParallelLinear(dim, hidden, **kw)
        self.fc2 = RowParallelLinear(hidden, dim, **kw)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(nnx.gelu(self.fc1(self.ln(x)), approximate=False))


class ParallelMLPTransformer(nnx.Module):
    """``MLPTransformer`` for ``shard_map``: tensor-parallel blocks, tokens split as the input is.

    Its parameter tree equals the serial model's, so ``nnx.update(parallel,
    nnx.state(serial))`` copies a serial model in. Run it with ``nnx_functional``.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        depth: int,
        *,
        axis: str = "tp",
        sequence_parallel: bool = False,
        rngs: nnx.Rngs,
    ) -> None:
        self.blocks = nnx.List(
            [
                ParallelMLPBlock(
                    dim, hidden, axis=axis, sequence_parallel=sequence_parallel, rngs=rngs
                )
                for _ in range(depth)
            ]
        )
        self.norm = nnx.LayerNorm(dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        for block in self.blocks:
            x = block(x)
        return self.norm(x)
