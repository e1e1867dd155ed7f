"""Layer-to-stage partition: which layers each pipeline stage computes (docs/pipeline.md).

A partition is written as Megatron-core writes ``pipeline_model_parallel_layout``: one string
per stage, ``E`` the embedding, ``t`` a transformer layer, ``m`` a multi-token-prediction
layer, ``L`` the loss (with the final norm and output layer), stages joined by ``|``, in
stage order: ``"Et*3|t*3|t*3|tL"``. Without a layout, layers are spread as torchtitan's
``generate_llm_fqn_per_model_part`` spreads them: the embedding and the loss count as
``input_weight`` and ``output_weight`` layers, so the first and last stages hold fewer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._specs import ParamSpec

LAYER_TOKENS = {"E": "embedding", "t": "transformer layer", "m": "MTP layer", "L": "loss"}
MAX_LAYERS = 1 << 16  # a layout string unrolls to at most this many layers
_GROUP = re.compile(r"\(([^()]+)\)\*(\d+)")
_REPEAT = re.compile(r"(.)\*(\d+)")

Partition = tuple[tuple[str, tuple[str, ...]], ...]  # per stage: (layout tokens, module names)


def parse_layout(layout: str) -> tuple[str, ...]:
    """Megatron-core's layout string as one token string per stage.

    Commas are cosmetic; ``(..)*n`` and ``x*n`` repeat, as in Megatron-core's
    ``parse_str_to_list``. Megatron-core's rules apply: the embedding comes once, first; the
    loss once, last. Every stage holds at least one layer.

    Example:
        >>> parse_layout("Et*3|(tt|)*2,tL")
        ('Ettt', 'tt', 'tt', 'tL')

    Raises:
        ValueError: for an unknown character, an empty stage, a misplaced ``E`` or ``L``, or
            a layout of more than ``MAX_LAYERS`` layers.
    """
    if not isinstance(layout, str):
        raise TypeError(f"a layout is a string such as 'Et*3|t*3|t*3|tL', got {layout!r}")
    text = layout.replace(",", "")
    for pattern in (_GROUP, _REPEAT):
        text = pattern.sub(lambda m: _repeat(m.group(1), m.group(2), layout), text)
    stages = tuple(text.split("|"))
    for i, stage in enumerate(stages):
        bad = sorted(set(stage) - set(LAYER_TOKENS))
        if bad:
            raise ValueError(
                f"layout {layout!r} has {bad[0]!r} in stage {i}; layers are E (embedding), "
                "t (transformer layer), m (MTP layer) and L (loss), stages are joined by '|'"
            )
        if not stage:
            raise ValueError(
                f"stage {i} of layout {layout!r} is empty; give every stage at least one layer"
            )
    flat = "".join(stages)
    if flat.count("E") != 1 or not flat.startswith("E"):
        raise ValueError(
            f"layout {layout!r} must start with the embedding E and name it once "
            "(Megatron-core's rule)"
        )
    if flat.count("L") != 1 or not flat.endswith("L"):
        raise ValueError(
            f"layout {layout!r} must end with the loss L and name it once (Megatron-core's rule)"
        )
    return stages


def _repeat(unit: str, times: str, layout: str) -> str:
    if len(unit) * int(times) > MAX_LAYERS:
        raise ValueError(
            f"layout {layout!r} unrolls to more than {MAX_LAYERS:,} layers; give fewer"
        )
    return unit * int(times)


def layout_string(stages: Sequence[str]) -> str:
    """The layout of per-stage token strings, runs written ``x*n``: the inverse of
    ``parse_layout`` (``("Ettt", "tt", "ttL")`` -> ``"Et*3|t*2|t*2L"``)."""
    return "|".join(
        re.sub(r"(.)\1+", lambda m: f"{m.group(1)}*{len(m.group(0))}", s) for s in stages
    )


def partition_layers(
    num_layers: int, num_stages: int, *, input_weight: int = 1, output_weight: int = 1
) -> tuple[str, ...]:
    """Transformer layers spread over stages, lighter first and last stages: torchtitan's
    ``generate_llm_fqn_per_model_part``.

    The embedding counts as ``input_weight`` layers and the loss (norm and output) as
    ``output_weight``; the ``num_layers + input_weight + output_weight`` effective layers are
    spread evenly, the earlier stages taking one more where they do not divide.

    Example:
        >>> partition_layers(8, 4)
        ('Ett', 'ttt', 'tt', 'tL')

    Raises:
        ValueError: where torchtitan refuses: more stages than effective layers, or a
            weight above the layers a stage gets.
    """
    for name, value, low in (
        ("num_layers", num_layers, 0),
        ("num_stages", num_stages, 1),
        ("input_weight", input_weight, 0),
        ("output_weight", output_weight, 0),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if num_layers > MAX_LAYERS:
        raise ValueError(f"num_layers must be at most {MAX_LAYERS:,}, got {num_layers:,}")
    if num_stages == 1:
        return ("E" + "t" * num_layers + "L",)
    effective = num_layers + input_weight + output_weight
    per, extra = divmod(effective, num_stages)
    if per == 0:
        raise ValueError(
            f"{num_stages} stages are more than the {effective} effective layers ({num_layers} "
            f"layers + input_weight {input_weight} + output_weight {output_weight}); use fewer "
            "stages or more layers"
        )
    if max(input_weight, output_weight) > per:
        raise ValueError(
            f"input_weight {input_weight} or output_weight {output_weight} exceeds the "
            f"{per} effective layers each of {num_stages} stages gets; lower the weights or "
            "the stages, or give a layout"
        )
    sizes = [per + (i < extra) for i in range(num_stages)]
    sizes[0] -= input_weight
    sizes[-1] -= output_weight
    stages = ["t" * size for size in sizes]
    stages[0], stages[-1] = "E" + stages[0], stages[-1] + "L"
    return tuple(stages)


def generic_modules(stages: Sequence[str]) -> Partition:
    """Each stage with the names of what it computes, by position: ``embedding``,
    ``layers.i`` (the i-th transformer layer), ``mtp.j``, ``loss``."""
    counts = {"t": 0, "m": 0}
    out = []
    for tokens in stages:
        names = []
        for token in tokens:
            if token in counts:
                names.append(f"{'layers' if token == 't' else 'mtp'}.{counts[token]}")
                counts[token] += 1
            else:
                names.append("embedding" if token == "E" else "loss")
        out.append((tokens, tuple(names)))
    return tuple(out)


def partition_specs(
    specs: Sequence[ParamSpec], num_stages: int, *, input_weight: int = 1, output_weight: int = 1
) -> Partition:
    """The model's blocks spread over stages as ``partition_layers`` spreads layers.

    Blocks are ``block_prefixes`` (the first numbered module of each parameter's path:
    ``transformer.h.3``); the modules registered before the first block are the embedding
    (``E``), those after the last the loss stage's norm and output (``L``).

    Raises:
        ValueError: if the specs have no numbered blocks, a parameter outside every block sits
            between two blocks, or ``partition_layers`` refuses.
    """
    blocks = block_prefixes(specs)
    if not blocks:
        raise ValueError(
            "the parameters have no numbered blocks (such as layers.0) to spread over stages; "
            "give layers= or a layout instead"
        )
    index = {prefix: i for i, prefix in enumerate(blocks)}
    block_of: dict[str, int] = {}
    for spec in specs:
        parts = spec.name.split(".")
        for i in range(1, len(parts)):
            if ".".join(parts[:i]) in index:
                block_of[spec.name] = index[".".join(parts[:i])]
                break
    head: dict[str, None] = {}
    tail: dict[str, None] = {}
    seen = 0
    for spec in specs:
        if spec.name in block_of:
            seen = max(seen, block_of[spec.name] + 1)
            continue
        module = spec.name.rpartition(".")[0] or spec.name
        if seen == 0:
            head[module] = None
        elif seen == len(blocks):
            tail[module] = None
        else:
            raise ValueError(
                f"parameter {spec.name!r} sits between blocks {blocks[seen - 1]!r} and "
                f"{blocks[seen]!r} outside both; a stage holds whole blocks in order, so give a "
                "layout or layers= instead"
            )
    tokens = partition_layers(
        len(blocks),
        num_stages,
        input_weight=input_weight if head else 0,
        output_weight=output_weight if tail else 0,
    )
    out, taken = [], 0
    for stage in tokens:
        count = stage.count("t")
        names = (list(head) if "E" in stage else []) + blocks[taken : taken + count]
        names += list(tail) if "L" in stage else []
        taken += count
        if not head:
            stage = stage.replace("E", "")
        if not tail:
            stage = stage.replace("L", "")
        out.append((stage, tuple(names)))
    return tuple(out)
