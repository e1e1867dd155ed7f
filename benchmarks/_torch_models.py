"""The torch benchmarks' models, batches and shared command-line options (docs/design.md §11).

Three models, picked with ``--model``:

- ``mlp`` (default): ``layers`` x (Linear(width, width) + GELU), batch 32 rows; 24 x 1024 is
  the 25M-parameter model of the README figures.
- ``many-small``: ``layers`` x Linear(width, width) with tanh residuals
  (``x = x + tanh(layer(x))``), 500 x 64, batch 64: a thousand small tensors, so the per-parameter
  cost of the gradient hooks dominates, not the arithmetic.
- ``gpt``: a decoder-only transformer from torch.nn layers (token and position embeddings, a
  stack of pre-LayerNorm blocks of causal self-attention + 4x MLP, a head tied to the token
  embedding); on a GPU 12 x 768, 32,000 tokens, 16 sequences of 512: about 110M parameters.
  On the CPU the default is 4 x 256, 4 sequences of 128 (11.4M parameters), so ``--quick``
  stays short; the flags set any size on either.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

MODELS = ("mlp", "many-small", "gpt")
# Per model: layers, width, batch (rows or sequences per rank), sequence length.
MODEL_DEFAULTS = {
    "mlp": (24, 1024, 32, 0),
    "many-small": (500, 64, 64, 0),
    "gpt": (12, 768, 16, 512),
    "gpt-cpu": (4, 256, 4, 128),
}


class TanhResidualStack(nn.Module):
    """``x = x + tanh(layer(x))`` over ``layers`` square Linear layers."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return x


class DecoderBlock(nn.Module):
    """Pre-LayerNorm causal self-attention, then a 4x GELU MLP, each with a residual."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln_attn = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, heads, batch_first=True)
        self.ln_mlp = nn.LayerNorm(width)
        self.fc_in = nn.Linear(width, 4 * width)
        self.fc_out = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor, causal_mask: torch.Tensor) -> torch.Tensor:
        h = self.ln_attn(x)
        x = x + self.attn(h, h, h, attn_mask=causal_mask, is_causal=True, need_weights=False)[0]
        return x + self.fc_out(nn.functional.gelu(self.fc_in(self.ln_mlp(x))))


class TinyGPT(nn.Module):
    """A GPT-2-shaped language model; the output head shares the token embedding's weight."""

    def __init__(self, layers: int, width: int, heads: int, vocab: int, seq: int) -> None:
        super().__init__()
        self.token_embedding = nn.Embedding(vocab, width)
        self.position_embedding = nn.Embedding(seq, width)
        self.blocks = nn.ModuleList(DecoderBlock(width, heads) for _ in range(layers))
        self.ln_final = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.token_embedding.weight  # tied, as in GPT-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        seq = tokens.shape[1]
        positions = torch.arange(seq, device=tokens.device)
        causal_mask = nn.Transformer.generate_square_subsequent_mask(seq, device=tokens.device)
        x = self.token_embedding(tokens) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x, causal_mask)
        return self.head(self.ln_final(x))


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The options every torch benchmark shares: rounds, world size, the model and its size."""
    parser.add_argument("--quick", action="store_true", help="fewer rounds (< 2 min)")
    parser.add_argument("--steps", type=int, default=None, help="timed rounds (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--world-size", type=int, help="ranks (default 2; --device cuda: GPUs)")
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--layers", type=int, help="default: 24 mlp, 500 many-small, 12 gpt")
    parser.add_argument("--width", type=int, help="default: 1024 mlp, 64 many-small, 768 gpt")
    # gpt's defaults above are the GPU's; on the CPU they are 4 x 256, batch 4, seq 128.
    parser.add_argument(
        "--batch", type=int, help="per rank; default: 32 mlp, 64 many-small, 16 gpt"
    )
    parser.add_argument("--seq", type=int, help="gpt: tokens per sequence (default 512)")
    parser.add_argument("--vocab", type=int, default=32000, help="gpt: vocabulary size")
    parser.add_argument("--heads", type=int, help="gpt: attention heads (default: width // 64)")


def fill_model_defaults(args: argparse.Namespace, device: str = "cpu") -> None:
    """Replace the size options left unset by the chosen model's defaults on ``device``."""
    on_cpu_gpt = args.model == "gpt" and device == "cpu"
    layers, width, batch, seq = MODEL_DEFAULTS["gpt-cpu" if on_cpu_gpt else args.model]
    args.seq = seq if args.seq is None else args.seq
    args.layers = layers if args.layers is None else args.layers
    args.width = width if args.width is None else args.width
    args.batch = batch if args.batch is None else args.batch
    if args.heads is None:
        args.heads = max(1, args.width // 64)


def build_model(args: argparse.Namespace) -> nn.Module:
    """The model ``args.model`` names, with the same weights on every rank and every call."""
    torch.manual_seed(0)
    if args.model == "many-small":
        return TanhResidualStack(args.layers, args.width)
    if args.model == "gpt":
        return TinyGPT(args.layers, args.width, args.heads, args.vocab, args.seq)
    blocks: list[nn.Module] = []
    for _ in range(args.layers):
        blocks += [nn.Linear(args.width, args.width), nn.GELU()]
    return nn.Sequential(*blocks)


def make_batch(
    args: argparse.Namespace, rank: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's batch: (input, target); random tokens for ``gpt``, random rows otherwise."""
    gen = torch.Generator().manual_seed(1000 + rank)
    if args.model != "gpt":
        return torch.randn(args.batch, args.width, generator=gen).to(device), None
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=gen).to(device)
    return tokens[:, :-1], tokens[:, 1:]  # next-token prediction


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """Mean squared output for the MLPs, next-token cross-entropy (in float32) for ``gpt``."""
    out = model(inputs)
    if targets is None:
        return out.float().square().mean()
    return nn.functional.cross_entropy(out.float().flatten(0, 1), targets.flatten())


def describe(args: argparse.Namespace, params: int) -> str:
    """One phrase naming the model, its size and the batch, for the report's first line."""
    if args.model == "many-small":
        shape = f"{args.layers} x Linear({args.width}, {args.width}) + tanh residual"
    elif args.model == "gpt":
        shape = (
            f"GPT {args.layers} x {args.width} ({args.heads} heads, vocab {args.vocab}, "
            f"seq {args.seq})"
        )
    else:
        shape = f"{args.layers} x Linear({args.width}, {args.width}) + GELU"
    return f"{shape} ({params / 1e6:.1f} M parameters), batch {args.batch} per rank"


def count_params(model: nn.Module) -> int:
    """Trainable elements, each shared tensor once (``parameters()`` already deduplicates)."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
