"""Stage modules from a model's blocks, split where a pipeline plan cuts (docs/pipeline.md).

A model given as its chain of blocks (``nn.Sequential(embedding, *layers, head)``, a list of
``(name, block)``, or a mapping) is cut by the plan's layout: each stage takes as many
consecutive blocks as its layout has letters (``"Ettt"``: four). A stage is a ``StageModule``
that calls its blocks in turn and registers each under its name in the model, so its
``state_dict`` keys are the model's own (``"3.attn.qkv.weight"``): a checkpoint stays in model
space whatever the cut. Stages are deep copies, so two stages never share a parameter: a weight
the model ties across stages (an embedding and its output layer) becomes one copy per stage,
listed in ``StageSplit.tied`` for the pipeline to sum their gradients (Megatron-core's
embedding group).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch import nn

from gradsync_core import PipelinePlan
from gradsync_torch.groups import Group

Blocks = nn.Sequential | nn.ModuleList | Sequence[tuple[str, nn.Module]] | Mapping[str, nn.Module]


class StageModule(nn.Module):
    """Consecutive blocks of a model, called in order, under their names in the model.

    Args:
        blocks: ``(name, module)`` pairs in the order the model calls them; a dotted name
            (``"layers.3"``) is registered as nested containers, so ``state_dict()`` has the
            model's keys.

    Example:
        >>> stage = StageModule([("1", nn.Linear(4, 4)), ("2", nn.ReLU())])
        >>> sorted(stage.state_dict())
        ['1.bias', '1.weight']
    """

    def __init__(self, blocks: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__()
        if not blocks:
            raise ValueError("a stage holds at least one block")
        self.block_names = tuple(name for name, _ in blocks)
        for name, block in blocks:
            parent: nn.Module = self
            *path, leaf = name.split(".")
            for part in path:
                child = parent._modules.get(part)
                if child is None:
                    child = nn.Module()
                    parent.add_module(part, child)
                parent = child
            if leaf in parent._modules:
                raise ValueError(f"two blocks are named {name!r}; give every block its own name")
            parent.add_module(leaf, block)

    def forward(self, *args: Any) -> Any:
        for name in self.block_names:
            out = self.get_submodule(name)(*args)
            args = out if isinstance(out, tuple) else (out,)
        return out


class StageSplit(NamedTuple):
    """What ``split_model`` gives one pipeline rank.

    ``stages``: this rank's ``StageModule`` by stage index. ``tied``: each weight the model
    shares between two stages, as the pair of its names (``("0.token.weight",
    "9.out.weight")``) in stage order; ``Pipeline(..., tied=split.tied)`` sums their gradients.
    ``names``: every stage's parameter names, in stage order (the whole model's).
    """

    stages: dict[int, StageModule]
    tied: tuple[tuple[str, str], ...]
    names: tuple[tuple[str, ...], ...]


def _named_blocks(blocks: Blocks) -> list[tuple[str, nn.Module]]:
    if isinstance(blocks, nn.Sequential | nn.ModuleList):
        return list(blocks.named_children())
    if isinstance(blocks, Mapping):
        return list(blocks.items())
    if isinstance(blocks, nn.Module):
        raise TypeError(
            f"split_model takes the model as its chain of blocks (nn.Sequential, nn.ModuleList, "
            f"[(name, block), ...] or {{name: block}}), got a {type(blocks).__name__}; list "
            "the blocks its forward calls in turn"
        )
    named = list(blocks)
    for item in named:
        if not (
            isinstance(item, tuple)
            and len(item) == 2
            and isinstance(item[0], str)
            and isinstance(item[1], nn.Module)
        ):
            raise TypeError(f"blocks are (name, nn.Module) pairs, got {item!r}")
    return named


def block_counts(plan: PipelinePlan) -> list[int]:
    """How many blocks each stage takes: the letters of its layout.

    Raises:
        ValueError: for a plan without layouts (read from a CSV without ``layout=``).
    """
    counts = [len(stage.layout) for stage in plan.stages]
    if not all(counts):
        raise ValueError(
            "the plan has no layout for its stages (a CSV read without layout=), so there is "
            "no telling where to cut; give PipelinePlan.from_csv a layout, or build the stage "
            "modules yourself"
        )
    return counts


def split_model(blocks: Blocks, plan: PipelinePlan, pp_rank: int) -> StageSplit:
    """Cut a model's chain of blocks into the plan's stages; keep ``pp_rank``'s.

    Every rank builds the whole model with the same weights, calls this with its place in
    its pipeline group (``groups.group_rank("pp")``) and keeps its stages; the model itself is
    left as it was (stages are copies).

    Args:
        blocks: the model as the blocks its forward calls in turn, one per layout letter
            (``E``, each ``t``/``m``, ``L``): ``nn.Sequential(embed, *layers, head)``, an
            ``nn.ModuleList``, ``[(name, block), ...]`` or ``{name: block}``.
        plan: the pipeline plan; its stages' layouts say where to cut.
        pp_rank: this rank's place in its pipeline group.

    Returns:
        A ``StageSplit``: this rank's stages, the weights tied across stages, every stage's
        parameter names.

    Raises:
        ValueError: when the blocks do not add up to the plan's layout, or a weight is shared
            by more than two stages.

    Example:
        >>> plan = plan_pipeline(schedule="GPipe", microbatches=2, topology=Topology(pp=2),
        ...                      layers=2)
        >>> split = split_model(nn.Sequential(*(nn.Linear(4, 4) for _ in range(4))), plan, 1)
        >>> list(split.stages), split.stages[1].block_names
        ([1], ('2', '3'))
    """
    named = _named_blocks(blocks)
    counts = block_counts(plan)
    if len(named) != sum(counts):
        raise ValueError(
            f"the model has {len(named)} blocks but the plan's layout {plan.layout!r} has "
            f"{sum(counts)} ({counts} per stage); give one block per layout letter: the "
            "embedding, each layer, the head"
        )
    if not 0 <= pp_rank < plan.pp:
        raise ValueError(f"pp_rank must be in 0..{plan.pp - 1}, got {pp_rank}")
    cuts = [sum(counts[:s]) for s in range(len(counts) + 1)]
    per_stage = [named[cuts[s] : cuts[s + 1]] for s in range(len(counts))]
    names = tuple(
        tuple(n for n, _ in StageModule(list(stage)).named_parameters()) for stage in per_stage
    )
    tied = _tied(per_stage)
    stages = {
        s: StageModule(copy.deepcopy(per_stage[s], _shared_handles(per_stage[s])))
        for s in range(len(counts))
        if plan.stages[s].rank == pp_rank
    }
    return StageSplit(stages=stages, tied=tied, names=names)


def _shared_handles(blocks: Sequence[tuple[str, nn.Module]]) -> dict[int, Any]:
    """A deepcopy memo that keeps process groups (and gradsync's ``Group``s holding them) as
    they are: a copied tensor-parallel layer talks over the same group."""
    memo: dict[int, Any] = {}
    for _, block in blocks:
        for module in block.modules():
            for value in vars(module).values():
                if isinstance(value, Group | dist.ProcessGroup):
                    memo[id(value)] = value
    return memo


def _tied(per_stage: Sequence[Sequence[tuple[str, nn.Module]]]) -> tuple[tuple[str, str], ...]:
    """Each parameter object held by two stages, as its pair of names, in stage order."""
    where: dict[int, list[tuple[int, str]]] = {}
    for s, blocks in enumerate(per_stage):
        seen: set[int] = set()
        for name, param in StageModule(list(blocks)).named_parameters(remove_duplicate=False):
            if id(param) not in seen:
                seen.add(id(param))
                where.setdefault(id(param), []).append((s, name))
    pairs = []
    for holders in where.values():
        if len(holders) > 2:
            listed = ", ".join(f"{n!r} (stage {s})" for s, n in holders)
            raise ValueError(
                f"a weight is shared by {len(holders)} stages ({listed}); a pipeline sums a "
                "tied weight's gradient between two stages only"
            )
        if len(holders) == 2:
            pairs.append((holders[0][1], holders[1][1]))
    return tuple(sorted(pairs))
