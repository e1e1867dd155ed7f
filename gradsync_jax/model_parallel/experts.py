"""A mixture-of-experts block in Flax NNX, experts sharded over ``ep`` (docs/design.md §5, §6).

The JAX twin of ``gradsync_torch.model_parallel.experts``. The expert weights are stacked
along their first dimension and annotated ``("ep", None, None)``: that ``PartitionSpec`` IS
the declaration, since ``shared_param_specs`` marks every parameter sharded over ``"ep"`` as
an expert parameter (``ParamSpec.expert``), whose gradient ``data_parallel_step`` averages
over ``edp`` instead of the dense data-parallel axes. The router is an unannotated (dense)
parameter.

Dispatch is Megatron-core's all-gather dispatcher: inside ``jax.shard_map`` over the expert
mesh (``mesh_from_topology(topology, expert=True)``) each device gathers the ``ep`` group's
tokens and router probabilities, applies its experts to the tokens routed to them and
reduce-scatters the outputs back. Called outside ``shard_map`` with ``axis=None`` the block is
its own serial reference: every expert on one device.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import lax

from gradsync_jax.model_parallel.mappings import all_gather_from, reduce_scatter_to

EXPERT_AXIS = "ep"


class MoE(nnx.Module):
    """A top-1 mixture-of-experts MLP: a dense router and ``num_experts`` GELU MLPs.

    Args:
        dim, hidden, num_experts: model width, expert hidden width, experts of the layer.
        axis: the expert-parallel mesh axis; ``None``: the serial block (no collectives).
        param_dtype: dtype of the parameters.
        rngs: NNX random streams for the initializers.

    The parameter tree is the same with or without ``axis`` (global shapes): the sharded
    block and its serial twin load each other's parameters. Each token goes to the expert of
    highest router probability, scaled by that probability. Every device of the ``ep`` group
    must hold the same number of tokens; ``num_experts`` must divide by the ``ep`` size.

    Example:
        >>> moe = MoE(8, 16, 4, rngs=nnx.Rngs(0))
        >>> nnx_functional(moe)[2]["w_in"]
        PartitionSpec('ep', None, None)
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        *,
        axis: str | None = EXPERT_AXIS,
        param_dtype: Any = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        self.axis = axis
        init = nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.router = nnx.Param(
            nnx.initializers.lecun_normal()(rngs.params(), (dim, num_experts), param_dtype)
        )
        sharding = (EXPERT_AXIS, None, None)  # experts split over ep: the expert declaration
        self.w_in = nnx.Param(
            init(rngs.params(), (num_experts, dim, hidden), param_dtype),
            out_sharding=sharding,
            eager_sharding=False,
        )
        self.w_out = nnx.Param(
            init(rngs.params(), (num_experts, hidden, dim), param_dtype),
            out_sharding=sharding,
            eager_sharding=False,
        )

    def __call__(self, x: jax.Array) -> jax.Array:
        tokens = x.reshape(-1, x.shape[-1])
        probs = jax.nn.softmax(tokens @ self.router[...], axis=-1)
        w_in, w_out = self.w_in[...], self.w_out[...]
        local = w_in.shape[0]  # experts on this device
        first: int | jax.Array = 0
        if self.axis is not None:
            count = tokens.shape[0] * lax.axis_size(self.axis)
            tokens = all_gather_from(tokens, self.axis, dim=0, size=count)
            probs = all_gather_from(probs, self.axis, dim=0, size=count)
            first = lax.axis_index(self.axis) * local
        expert_index = jnp.argmax(probs, axis=-1)
        gate = jnp.take_along_axis(probs, expert_index[:, None], axis=-1)[:, 0]
        out = jnp.zeros_like(tokens)
        for e in range(local):
            # Every expert runs on every token and is masked: shapes stay static under jit.
            weight = jnp.where(expert_index == first + e, gate, 0.0)[:, None]
            out = out + weight * (jax.nn.gelu(tokens @ w_in[e], approximate=False) @ w_out[e])
        if self.axis is not None:
            out = reduce_scatter_to(out, self.axis, dim=0)
        return out.reshape(x.shape)
