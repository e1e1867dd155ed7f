"""The Llama-style reference decoder's shape and the options of its parallelization.

One record for both frameworks: ``examples/llama_torch.py`` and ``examples/llama_nnx.py`` build
the same model from a ``LlamaConfig`` (torchtitan's Llama 3 weight names, so a Flax NNX tree maps
onto the torch names by ``gradsync_jax``'s naming rules), and each framework's ``parallelize``
takes a ``gradsync_core.Topology`` and a ``ParallelOptions``. ``check_layout`` is the one place
that says whether a model can be laid out on a topology; both frameworks call it before building
anything. Standard library only, like the planners.
"""

from __future__ import annotations

from dataclasses import dataclass

from gradsync_core import Topology


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-style decoder: RMSNorm, rotary positions, SwiGLU MLP, grouped-query attention.

    ``n_experts > 0`` replaces every layer's MLP with a mixture of ``n_experts`` SwiGLU experts
    routed top-``top_k`` (the MoE variant). ``tie_embeddings`` makes the output projection the
    token embedding's weight.
    """

    vocab_size: int = 128
    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    n_experts: int = 0
    top_k: int = 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


@dataclass(frozen=True)
class ParallelOptions:
    """How ``parallelize`` applies the topology's axes (torchtitan's job-config knobs, small).

    Args:
        microbatches: microbatches per step when ``pp > 1``.
        schedule: the pipeline schedule's name (``gradsync_core.plan.pipeline``'s names).
        sequence_parallel: with ``tp > 1``, norms and residuals hold a ``1/tp`` slice of the
            sequence (Megatron's sequence parallelism).
        reshard_after_forward: FSDP2's option for the ``dp_shard`` axis.
    """

    microbatches: int = 4
    schedule: str = "1F1B"
    sequence_parallel: bool = True
    reshard_after_forward: bool = True


def check_layout(config: LlamaConfig, topology: Topology, seq_len: int | None = None) -> None:
    """Refuse, with one sentence, a topology the model cannot be laid out on.

    Raises:
        ValueError: a size that does not divide what it splits (heads over ``tp``, layers over
            ``pp``, experts over ``ep``, the sequence over ``cp`` and ``tp``).
    """
    if config.dim % config.n_heads:
        raise ValueError(f"dim {config.dim} is not a multiple of n_heads {config.n_heads}.")
    if config.n_heads % config.n_kv_heads:
        raise ValueError(
            f"n_heads {config.n_heads} is not a multiple of n_kv_heads {config.n_kv_heads}."
        )
    splits = [
        ("n_heads", config.n_heads, "tp", topology.tp),
        ("n_kv_heads", config.n_kv_heads, "tp", topology.tp),
        ("ffn_dim", config.ffn_dim, "tp", topology.tp),
        ("n_layers", config.n_layers, "pp", topology.pp),
    ]
    if config.n_experts:
        splits.append(("n_experts", config.n_experts, "ep", topology.ep))
    elif topology.ep > 1:
        raise ValueError(f"ep={topology.ep} needs the MoE variant: set n_experts > 0.")
    if seq_len is not None:
        splits.append(("the sequence length", seq_len, "cp * 2", topology.cp * 2))
        splits.append(("the sequence length", seq_len, "tp", topology.tp))
    for what, size, axis, parts in splits:
        if size % parts:
            raise ValueError(
                f"{what} {size} is not divisible by {axis}={parts}: pick a {axis} that divides it."
            )
