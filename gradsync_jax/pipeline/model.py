"""A model as the pipeline sees it: an embedding, a stack of equal blocks, a head with the loss.

The stack is how MaxText and Flax scan layers: every parameter of the blocks has a leading
layer dimension (``nnx.vmap`` over a block's constructor, ``nn.scan``/``nn.vmap`` in linen,
or a ``jax.vmap``-ed init). The parameters are one dict ``{"embed": ..., "blocks": ...,
"head": ...}`` (``layout.py`` places them on the pipeline).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

PARTS = ("embed", "blocks", "head")


@dataclass(frozen=True, slots=True, kw_only=True)
class PipelineModel:
    """The three functions a pipeline runs (``nnx_model`` and ``linen_model`` build them).

    Args:
        embed: ``embed(params["embed"], inputs) -> activations``, on the first stage.
        block: ``block(one block's params, activations) -> activations`` of the same shape
            and dtype; stage s runs blocks ``s*k .. s*k + k - 1`` in order.
        head: ``head(params["head"], activations, targets) -> loss``, the mean loss of one
            microbatch, on the last stage.
    """

    embed: Callable[[Any, Any], jax.Array]
    block: Callable[[Any, jax.Array], jax.Array]
    head: Callable[[Any, jax.Array, Any], jax.Array]
