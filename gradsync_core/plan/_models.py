"""Built-in parameter tables, so plans can be shown without downloading a model."""

from __future__ import annotations

from collections.abc import Callable

from gradsync_core.plan._llama import LLAMA_MODELS
from gradsync_core.plan._specs import ParamSpec


def gpt2_small(dtype: str = "float32") -> list[ParamSpec]:
    """GPT-2 small (124,439,808 parameters) with Hugging Face names; ``lm_head`` is tied to
    ``wte`` and so listed once. Conv1D weights are (in, out) as in the original checkpoint."""
    d, ff, vocab, ctx, layers = 768, 3072, 50257, 1024, 12
    table: list[tuple[str, tuple[int, ...]]] = [
        ("transformer.wte.weight", (vocab, d)),
        ("transformer.wpe.weight", (ctx, d)),
    ]
    for i in range(layers):
        h = f"transformer.h.{i}"
        table += [
            (f"{h}.ln_1.weight", (d,)),
            (f"{h}.ln_1.bias", (d,)),
            (f"{h}.attn.c_attn.weight", (d, 3 * d)),
            (f"{h}.attn.c_attn.bias", (3 * d,)),
            (f"{h}.attn.c_proj.weight", (d, d)),
            (f"{h}.attn.c_proj.bias", (d,)),
            (f"{h}.ln_2.weight", (d,)),
            (f"{h}.ln_2.bias", (d,)),
            (f"{h}.mlp.c_fc.weight", (d, ff)),
            (f"{h}.mlp.c_fc.bias", (ff,)),
            (f"{h}.mlp.c_proj.weight", (ff, d)),
            (f"{h}.mlp.c_proj.bias", (d,)),
        ]
    table += [("transformer.ln_f.weight", (d,)), ("transformer.ln_f.bias", (d,))]
    return [ParamSpec(name=n, shape=s, dtype=dtype) for n, s in table]


def resnet50(dtype: str = "float32") -> list[ParamSpec]:
    """ResNet-50 (25,557,032 parameters) with torchvision's names and registration order."""
    table: list[tuple[str, tuple[int, ...]]] = [
        ("conv1.weight", (64, 3, 7, 7)),
        ("bn1.weight", (64,)),
        ("bn1.bias", (64,)),
    ]
    inplanes = 64
    for layer, (planes, blocks) in enumerate([(64, 3), (128, 4), (256, 6), (512, 3)], start=1):
        for block in range(blocks):
            p = f"layer{layer}.{block}"
            table += [
                (f"{p}.conv1.weight", (planes, inplanes, 1, 1)),
                (f"{p}.bn1.weight", (planes,)),
                (f"{p}.bn1.bias", (planes,)),
                (f"{p}.conv2.weight", (planes, planes, 3, 3)),
                (f"{p}.bn2.weight", (planes,)),
                (f"{p}.bn2.bias", (planes,)),
                (f"{p}.conv3.weight", (planes * 4, planes, 1, 1)),
                (f"{p}.bn3.weight", (planes * 4,)),
                (f"{p}.bn3.bias", (planes * 4,)),
            ]
            if block == 0:
                table += [
                    (f"{p}.downsample.0.weight", (planes * 4, inplanes, 1, 1)),
                    (f"{p}.downsample.1.weight", (planes * 4,)),
                    (f"{p}.downsample.1.bias", (planes * 4,)),
                ]
            inplanes = planes * 4
    table += [("fc.weight", (1000, 2048)), ("fc.bias", (1000,))]
    return [ParamSpec(name=n, shape=s, dtype=dtype) for n, s in table]


def mlp_25m(dtype: str = "float32") -> list[ParamSpec]:
    """The benchmarks' model: 24 x Linear(1024, 1024) (25,190,400 parameters)."""
    return [
        ParamSpec(name=f"layers.{i}.{kind}", shape=shape, dtype=dtype)
        for i in range(24)
        for kind, shape in (("weight", (1024, 1024)), ("bias", (1024,)))
    ]


MODELS: dict[str, Callable[[str], list[ParamSpec]]] = {
    "gpt2-small": gpt2_small,
    "resnet50": resnet50,
    "mlp-25m": mlp_25m,
}
# The Llama reference's shapes (``_llama``): gradsync plan --zero 3 divides them by every axis.
MODELS.update({name: shape.specs for name, shape in LLAMA_MODELS.items()})


def builtin_model(name: str, dtype: str = "float32") -> list[ParamSpec]:
    """The parameter table of a built-in model.

    Raises:
        ValueError: if ``name`` is not one of ``MODELS``.
    """
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}; built-in models: {', '.join(MODELS)}")
    return MODELS[name](dtype)
