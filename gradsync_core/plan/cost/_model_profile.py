"""The model profile: forward and backward time of each block of the model on one rank.

A block is a module path (``transformer.h.3``, ``transformer.wte``); the profile lists them in
forward order, and each parameter belongs to the block with the longest path that contains it
(``""`` catches every parameter no other block claims). The times are for one microbatch of
``samples`` samples; ``scaled`` moves them to another microbatch size linearly, the
approximation that compute grows with the work (docs/cost-model.md). Where a profile comes
from is part of it: ``"measured"`` (an executor's ``profile_model``, a short run of the user's
model), ``"given"`` (written by hand), or ``"flops"`` (``estimate_model_profile``: 2 FLOPs per
parameter and token forward, 4 backward, at an assumed rate; an estimate, and marked so).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from gradsync_core.plan._canonical import fingerprint
from gradsync_core.plan._param_units import block_prefixes
from gradsync_core.plan._specs import ParamSpec
from gradsync_core.plan.cost._machine import _check_header, _check_keys, _finite, read_json

MODEL_PROFILE_KIND = "model_profile"
MODEL_PROFILE_VERSION = 1
SOURCES = ("measured", "given", "flops")


def contains(prefix: str, name: str) -> bool:
    """Whether module path ``prefix`` contains ``name`` (``""`` contains everything)."""
    return not prefix or name == prefix or name.startswith(prefix + ".")


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockTime:
    """One block's cost for one microbatch.

    ``activation_bytes``: what its forward saves for its backward (None: not known, and then
    the memory figures leave activations out and say so); ``output_bytes``: the tensor it
    hands to the next block (a pipeline's point-to-point message at a stage boundary).
    """

    prefix: str
    forward_s: float
    backward_s: float
    activation_bytes: int | None = None
    output_bytes: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.prefix, str):
            raise TypeError(f"a block's prefix is a module path string, got {self.prefix!r}")
        _finite(f"block {self.prefix!r} forward_s", self.forward_s, positive=False)
        _finite(f"block {self.prefix!r} backward_s", self.backward_s, positive=False)
        for name in ("activation_bytes", "output_bytes"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 0):
                raise ValueError(f"block {self.prefix!r} {name} must be an int >= 0, got {value!r}")

    def to_json(self) -> dict[str, Any]:
        return {
            "prefix": self.prefix,
            "forward_s": self.forward_s,
            "backward_s": self.backward_s,
            "activation_bytes": self.activation_bytes,
            "output_bytes": self.output_bytes,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelProfile:
    """Per-block forward and backward times of one microbatch of ``samples`` samples on one
    rank, in forward order, and the optimizer step of all trainable parameters.

    Example:
        >>> profile = ModelProfile(samples=8, source="given", blocks=(
        ...     BlockTime(prefix="layers.0", forward_s=0.001, backward_s=0.002),
        ...     BlockTime(prefix="layers.1", forward_s=0.001, backward_s=0.002)))
        >>> profile.block_of("layers.1.weight"), profile.scaled(16).forward_s
        (1, 0.004)
    """

    blocks: tuple[BlockTime, ...]
    samples: int
    source: str
    optimizer_s: float = 0.0  # one step of the optimizer over every trainable parameter
    # The scratch that step allocates on top of the state (foreach Adam: a parameter-sized
    # temporary); None: not known, and then the optimizer's moment is not in the peak.
    optimizer_bytes: int | None = None
    note: str = ""  # how it was measured (framework, device, threads) or where it comes from

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a model profile needs at least one block")
        prefixes = [b.prefix for b in self.blocks]
        if len(set(prefixes)) != len(prefixes):
            twice = next(p for p in prefixes if prefixes.count(p) > 1)
            raise ValueError(f"block {twice!r} is listed twice in the model profile; list it once")
        if not isinstance(self.samples, int) or isinstance(self.samples, bool) or self.samples < 1:
            raise ValueError(f"samples must be a positive int, got {self.samples!r}")
        if self.source not in SOURCES:
            raise ValueError(f"source must be one of {SOURCES}, got {self.source!r}")
        _finite("optimizer_s", self.optimizer_s, positive=False)
        if self.optimizer_bytes is not None and (
            not isinstance(self.optimizer_bytes, int) or self.optimizer_bytes < 0
        ):
            raise ValueError(f"optimizer_bytes must be an int >= 0, got {self.optimizer_bytes!r}")

    @property
    def forward_s(self) -> float:
        return sum(b.forward_s for b in self.blocks)

    @property
    def backward_s(self) -> float:
        return sum(b.backward_s for b in self.blocks)

    @property
    def activation_bytes(self) -> int | None:
        """What one microbatch's forward saves for the backward, all blocks; None if a block
        does not say."""
        sizes = [b.activation_bytes for b in self.blocks]
        return None if any(s is None for s in sizes) else sum(s for s in sizes if s is not None)

    def block_of(self, name: str) -> int:
        """The index of the block that holds parameter (or module) ``name``.

        Raises:
            ValueError: no block contains it.
        """
        best, length = -1, -1
        for index, block in enumerate(self.blocks):
            if contains(block.prefix, name) and len(block.prefix) > length:
                best, length = index, len(block.prefix)
        if best < 0:
            raise ValueError(
                f"parameter {name!r} is in no block of the model profile; profile its module, "
                'or add a block with prefix "" for whatever no other block holds'
            )
        return best

    def scaled(self, samples: int) -> ModelProfile:
        """This profile for microbatches of ``samples`` samples: times and activation sizes
        in proportion (the optimizer step does not depend on the batch)."""
        if not isinstance(samples, int) or samples < 1:
            raise ValueError(f"samples must be a positive int, got {samples!r}")
        k = samples / self.samples
        blocks = tuple(
            replace(
                b,
                forward_s=b.forward_s * k,
                backward_s=b.backward_s * k,
                activation_bytes=None
                if b.activation_bytes is None
                else round(b.activation_bytes * k),
                output_bytes=round(b.output_bytes * k),
            )
            for b in self.blocks
        )
        return replace(self, blocks=blocks, samples=samples)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": MODEL_PROFILE_KIND,
            "version": MODEL_PROFILE_VERSION,
            "source": self.source,
            "samples": self.samples,
            "optimizer_s": self.optimizer_s,
            "optimizer_bytes": self.optimizer_bytes,
            "note": self.note,
            "blocks": [b.to_json() for b in self.blocks],
        }

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> ModelProfile:
        """Read ``to_json()``'s output (or a hand-written profile) back, checked.

        Raises:
            ValueError: another kind or version, a missing or unknown key, a bad value.
        """
        _check_header(obj, MODEL_PROFILE_KIND, MODEL_PROFILE_VERSION)
        _check_keys(
            obj,
            required=("samples", "source", "blocks"),
            optional=("kind", "version", "optimizer_s", "optimizer_bytes", "note"),
            what="a model profile",
        )
        if not isinstance(obj["blocks"], list):
            raise ValueError("a model profile's 'blocks' must be a list")
        blocks = []
        for entry in obj["blocks"]:
            _check_keys(
                entry,
                required=("prefix", "forward_s", "backward_s"),
                optional=("activation_bytes", "output_bytes"),
                what="a model profile block",
            )
            blocks.append(
                BlockTime(
                    prefix=entry["prefix"],
                    forward_s=entry["forward_s"],
                    backward_s=entry["backward_s"],
                    activation_bytes=entry.get("activation_bytes"),
                    output_bytes=entry.get("output_bytes", 0),
                )
            )
        return cls(
            blocks=tuple(blocks),
            samples=obj["samples"],
            source=obj["source"],
            optimizer_s=obj.get("optimizer_s", 0.0),
            optimizer_bytes=obj.get("optimizer_bytes"),
            note=str(obj.get("note", "")),
        )

    @classmethod
    def load(cls, path: str) -> ModelProfile:
        """Read a model profile file.

        Raises:
            ValueError: the file is unreadable or not a model profile.
        """
        return cls.from_json(read_json(path, "model profile"))

    @property
    def fingerprint(self) -> str:
        return fingerprint(self.to_json())


def median_profile(profiles: Sequence[ModelProfile]) -> ModelProfile:
    """One profile from several runs of the same blocks (steps of a profiler, or rounds
    between other work): the forward and the backward each take the median of the runs'
    totals, split over the blocks in proportion to each block's median. On a loaded machine
    a step is its blocks' undisturbed times plus the preemptions that hit it somewhere; the
    medians of the totals keep those, the per-block medians keep the split.

    Raises:
        ValueError: no profiles, or profiles of other blocks or batch sizes.

    Example:
        >>> runs = [ModelProfile(samples=1, source="measured", blocks=(
        ...     BlockTime(prefix="a", forward_s=f, backward_s=2 * f),
        ...     BlockTime(prefix="b", forward_s=1.0, backward_s=2.0))) for f in (1.0, 3.0, 1.0)]
        >>> [b.forward_s for b in median_profile(runs).blocks]
        [1.0, 1.0]
    """
    if not profiles:
        raise ValueError("median_profile needs at least one profile")
    first = profiles[0]
    for p in profiles:
        if [b.prefix for b in p.blocks] != [b.prefix for b in first.blocks] or (
            p.samples != first.samples
        ):
            raise ValueError("median_profile merges runs of the same blocks and batch size only")

    def split(total: float, parts: list[float]) -> list[float]:
        whole = sum(parts)
        return [total * x / whole if whole else total / len(parts) for x in parts]

    n = len(first.blocks)
    forward = split(
        statistics.median(p.forward_s for p in profiles),
        [statistics.median(p.blocks[i].forward_s for p in profiles) for i in range(n)],
    )
    backward = split(
        statistics.median(p.backward_s for p in profiles),
        [statistics.median(p.blocks[i].backward_s for p in profiles) for i in range(n)],
    )
    scratch = [p.optimizer_bytes for p in profiles if p.optimizer_bytes is not None]
    return replace(
        first,
        blocks=tuple(
            replace(b, forward_s=f, backward_s=g)
            for b, f, g in zip(first.blocks, forward, backward, strict=True)
        ),
        optimizer_s=statistics.median(p.optimizer_s for p in profiles),
        optimizer_bytes=max(scratch) if scratch else None,
    )


def profile_blocks(specs: Iterable[ParamSpec]) -> list[str]:
    """The module paths a profiler times, in registration order: each numbered block
    (``block_prefixes``: a ZeRO-3 unit, a pipeline layer) and, outside them, each parameter's
    module (``transformer.wte``, ``lm_head``), as ``plan_pipeline`` names a stage's modules.

    Example:
        >>> profile_blocks([ParamSpec(name=n, shape=(1,)) for n in
        ...                 ["wte.weight", "h.0.fc.weight", "h.1.fc.weight", "head.weight"]])
        ['wte', 'h.0', 'h.1', 'head']
    """
    specs = list(specs)
    blocks = block_prefixes(specs)
    found: dict[str, None] = {}
    for spec in specs:
        inside = [b for b in blocks if contains(b, spec.name)]
        found[inside[0] if inside else spec.name.rpartition(".")[0]] = None
    return list(found)


def estimate_model_profile(
    specs: Sequence[ParamSpec],
    *,
    tokens: int,
    flops_per_s: float,
    samples: int = 1,
    blocks: Sequence[str] | None = None,
) -> ModelProfile:
    """A FLOP-based profile where nothing was measured: a dense layer does 2 FLOPs per weight
    and token forward and 4 backward (the 6·N·D rule, Kaplan et al. arXiv:2001.08361), at
    ``flops_per_s`` achieved. Marked ``source="flops"``: attention's quadratic term,
    elementwise work and kernel efficiency are not in it, and no activation sizes are known.

    Args:
        specs: the parameters.
        tokens: tokens per microbatch (samples x sequence length).
        flops_per_s: the achieved rate (peak x utilization).
        samples: samples per microbatch, for ``scaled``.
        blocks: module paths (default ``profile_blocks(specs)``).

    Raises:
        ValueError: non-positive tokens, samples or rate.

    Example:
        >>> specs = [ParamSpec(name="fc.weight", shape=(1000, 1000))]
        >>> p = estimate_model_profile(specs, tokens=1000, flops_per_s=1e12)
        >>> p.source, p.blocks[0].forward_s, p.blocks[0].backward_s
        ('flops', 0.002, 0.004)
    """
    for name, value in (("tokens", tokens), ("samples", samples)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    _finite("flops_per_s", flops_per_s, positive=True)
    prefixes = list(blocks) if blocks is not None else profile_blocks(specs)
    probe = ModelProfile(
        blocks=tuple(BlockTime(prefix=p, forward_s=0, backward_s=0) for p in prefixes),
        samples=samples,
        source="flops",
    )
    weights = [0] * len(prefixes)
    for spec in specs:
        if spec.requires_grad and len(spec.shape) > 0:
            weights[probe.block_of(spec.name)] += math.prod(spec.shape)
    rate = float(flops_per_s)
    return replace(
        probe,
        blocks=tuple(
            BlockTime(prefix=p, forward_s=2 * w * tokens / rate, backward_s=4 * w * tokens / rate)
            for p, w in zip(prefixes, weights, strict=True)
        ),
        note=f"6 FLOPs per parameter and token at {rate:.3g} FLOP/s (an estimate)",
    )
