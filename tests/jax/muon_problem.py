"""The matrix-optimizer tests' model (test_zero_muon.py, tests/parity/test_matrix_optimizers.py):
the parameters of ``examples/pipeline_models.gpt_blocks(layers=2, width=16, vocab=32, seq=8)``
as a Flax tree, and Optax's Muon on its hidden matrices.
"""

from __future__ import annotations

import jax
import optax
import optax.contrib

from tests.support.models import random_params

LAYERS, WIDTH, VOCAB, SEQ = 2, 16, 32, 8
HIDDEN = ("qkv", "proj", "fc_in", "fc_out")


def gpt_shapes() -> dict:
    """The parameter shapes of ``gpt_blocks(layers=2, width=16, vocab=32, seq=8)`` as a
    Flax tree: torch's ``1.qkv.weight`` ``(48, 16)`` is ``["1"]["qkv"]["kernel"]`` ``(16, 48)``."""
    tree: dict = {
        "0": {"token": {"embedding": (VOCAB, WIDTH)}, "position": {"embedding": (SEQ, WIDTH)}}
    }
    for layer in range(1, LAYERS + 1):
        tree[str(layer)] = {
            "ln_attn": {"scale": (WIDTH,), "bias": (WIDTH,)},
            "qkv": {"kernel": (WIDTH, 3 * WIDTH), "bias": (3 * WIDTH,)},
            "proj": {"kernel": (WIDTH, WIDTH), "bias": (WIDTH,)},
            "ln_mlp": {"scale": (WIDTH,), "bias": (WIDTH,)},
            "fc_in": {"kernel": (WIDTH, 4 * WIDTH), "bias": (4 * WIDTH,)},
            "fc_out": {"kernel": (4 * WIDTH, WIDTH), "bias": (WIDTH,)},
        }
    tree[str(LAYERS + 1)] = {
        "ln": {"scale": (WIDTH,), "bias": (WIDTH,)},
        "out": {"kernel": (WIDTH, VOCAB)},
    }
    return tree


def gpt_params(seed: int = 0) -> dict:
    """``gpt_shapes()`` drawn from ``N(0, 0.5)``."""
    return random_params(gpt_shapes(), seed)


def hidden_matrices(params: dict) -> dict:
    """Muon's dimension numbers for the hidden layers' kernels, ``None`` (AdamW) elsewhere:
    the split torch users make between ``torch.optim.Muon`` and ``torch.optim.AdamW``."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    treedef = jax.tree.structure(params)
    dims = []
    for path, _ in paths:
        keys = [getattr(k, "key", None) for k in path]
        hidden = keys[-1] == "kernel" and keys[-2] in HIDDEN
        dims.append(optax.contrib.MuonDimensionNumbers() if hidden else None)
    return jax.tree.unflatten(treedef, dims)


def muon() -> optax.GradientTransformation:
    """Optax's Muon on the hidden matrices, its AdamW elsewhere."""
    return optax.contrib.muon(
        0.02, adam_learning_rate=1e-3, muon_weight_dimension_numbers=hidden_matrices
    )
