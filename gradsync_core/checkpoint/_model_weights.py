"""Model weights in a checkpoint: their names, their owners, and the check before loading.

Both executors store a model's weights beside the optimizer state, whole, in torch's names and
layouts (docs/checkpoints.md), and both refuse weights that do not match the model as
``load_state_dict(strict=True)`` would; the rules live here once.
"""

from __future__ import annotations

import os
from collections.abc import Collection, Sequence
from typing import Any

from gradsync_core.plan._shards import ShardPlan
from gradsync_core.plan._specs import ParamSpec

# Model weights saved beside the optimizer state are named "__model__/<param name>" (no
# parameter is called "__model__", and the key sorts apart from every state tensor).
MODEL_PARAM = "__model__"


# What DDP, nn.DataParallel and gradsync's DataParallel put before the model's own names.
WRAPPER_PREFIX = "module."


def is_wrapped(names: Collection[str]) -> bool:
    """Whether ``names`` are a data-parallel wrapper's: every one under ``module.``."""
    return bool(names) and all(name.startswith(WRAPPER_PREFIX) for name in names)


def unwrapped_names(names: Sequence[str]) -> list[str]:
    """The model's own names for a wrapper's (``module.fc.weight`` -> ``fc.weight``).

    A checkpoint stores the names the inner model has, as ``model.module`` gives them to a
    DDP user and as ``torch.distributed.checkpoint`` stores them, so a model trained inside
    ``DataParallel`` loads into the bare model and into JAX. A model whose parameters all sit
    under a child called ``module`` is treated as the same wrapper, on save and on load alike.
    """
    names = list(names)
    while is_wrapped(names):
        names = [name.removeprefix(WRAPPER_PREFIX) for name in names]
    return names


def model_key(param: str) -> str:
    """``"__model__/layers.0.weight"``: how a model weight is named inside a rank file."""
    return f"{MODEL_PARAM}/{param}"


def model_owners(plan: ShardPlan, names: Sequence[str]) -> dict[str, int]:
    """The rank whose file holds each model weight (whole, in torch's layout).

    Weights are replicated on every data-parallel rank, so any rank could write any of
    them; each goes with its optimizer state (the rank of the parameter's first non-empty
    shard) so the bytes spread like the state does, and a frozen parameter, which the plan
    does not list, goes to rank 0.
    """
    owners: dict[str, int] = {}
    for shard in plan.shards:
        if shard.stop > shard.start:
            owners.setdefault(shard.name, shard.rank)
    return {name: owners.get(name, 0) for name in names}


def weight_bytes(plan: ShardPlan, specs: Sequence[ParamSpec]) -> list[int]:
    """Bytes of model weights each rank's file holds when a save stores the model
    (``model_owners``), by rank: what a save with ``blocking=False`` stages beside the state.

    Example:
        >>> from gradsync_core import ParamSpec, plan_greedy_shards
        >>> specs = [ParamSpec(name="a", shape=(4,)), ParamSpec(name="b", shape=(2,))]
        >>> weight_bytes(plan_greedy_shards(specs, world_size=2), specs)
        [16, 8]
    """
    out = [0] * plan.world_size
    owners = model_owners(plan, [spec.name for spec in specs])
    for spec in specs:
        out[owners[spec.name]] += spec.nbytes
    return out


def check_weight_names(saved: Collection[str], expected: Collection[str], *, fix: str) -> None:
    """Refuse stored weights whose names are not exactly the model's (before any is copied).

    Args:
        saved: the names of the weights the checkpoint holds.
        expected: the names of the model's parameters (tied ones once).
        fix: what to do about it, ending the sentence.

    Raises:
        ValueError: naming the first name the checkpoint lacks and the first of its own that
            nothing matched, with how many of each.
    """
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    if not (missing or unexpected):
        return
    which = f"lacks {missing[0]!r}" if missing else f"has {unexpected[0]!r}, unknown here"
    theirs = (
        f"; the checkpoint's unmatched names start with {unexpected[0]!r}"
        if missing and unexpected
        else ""
    )
    raise ValueError(
        f"the checkpoint's model weights do not match the model: it {which} "
        f"({len(missing)} missing, {len(unexpected)} unexpected){theirs}; {fix}"
    )


def weight_owners(path: str | os.PathLike[str], manifest: Any) -> dict[str, int]:
    """The rank whose file holds each stored model weight (``extra["model"]``).

    Raises:
        ValueError: if the checkpoint at ``path`` holds no model weights.
    """
    owners = dict(manifest.extra.get("model", {}))
    if not owners:
        raise ValueError(
            f"{os.fspath(path)} holds no model weights; save it with "
            "ZeroRedundancyOptimizer.save(path, model=net) or save_optimizer_state(..., model=)"
        )
    return owners
