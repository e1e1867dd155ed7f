"""A GPT written as the chain of blocks a pipeline cuts (docs/pipeline.md).

``gpt_blocks`` returns ``nn.Sequential(embedding, *layers, head)``: one block per letter of a
pipeline layout (``E``, each ``t``, ``L``), each block taking the previous one's output, so
``split_model`` can cut it anywhere. Attention is written out (no fused kernels), so the
forward and backward are the same arithmetic wherever it runs. The tests and
benchmarks/torch_pipeline.py train it.
"""

from __future__ import annotations

import torch
from torch import nn


class Embedding(nn.Module):
    """Token and position embeddings, summed."""

    def __init__(self, vocab: int, seq: int, width: int) -> None:
        super().__init__()
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(seq, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.token(tokens) + self.position(positions)


class Layer(nn.Module):
    """A pre-LayerNorm decoder layer: causal self-attention, then a 4x GELU MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln_attn = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.ln_mlp = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln_attn(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-2, -1) / (d // self.heads) ** 0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attn = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, t, d))
        return x + self.fc_out(nn.functional.gelu(self.fc_in(self.ln_mlp(x))))


class Head(nn.Module):
    """The final LayerNorm and the output layer (logits)."""

    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(width)
        self.out = nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def gpt_blocks(
    layers: int = 8,
    width: int = 16,
    heads: int = 2,
    vocab: int = 32,
    seq: int = 8,
    *,
    tied: bool = False,
    seed: int = 0,
) -> nn.Sequential:
    """``nn.Sequential(Embedding, Layer * layers, Head)``, the same weights for a seed;
    ``tied``: the output layer shares the token embedding's weight (GPT-2)."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        Embedding(vocab, seq, width),
        *(Layer(width, heads) for _ in range(layers)),
        Head(width, vocab),
    )
    if tied:
        model[-1].out.weight = model[0].token.weight
    return model


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy, the mean over the microbatch's tokens."""
    return nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())


def token_batch(batch: int, seq: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens and their next-token targets."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, seq + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]
