"""Units of a parameter-shard plan: the parameters one ``fully_shard`` call gathers.

Found from module paths alone (docs/design.md §16).

FSDP2 applies ``fully_shard`` bottom-up; each call manages the parameters of its module's
subtree that no inner call already manages, collected by a children-first walk
(``_get_managed_modules``). The functions here reproduce that from ``named_parameters()``
names, so a Flax tree renamed to torch's paths gets the same units as the torch module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from gradsync_core.plan._specs import ParamSpec

ROOT = ""  # the root unit's prefix: it holds every parameter no block claims
_SEP = "."  # module paths are torch's; a Flax tree is renamed to them first (§13)


def _module_of(name: str) -> str:
    return name.rpartition(_SEP)[0]


def _ancestors(name: str) -> list[str]:
    """Module paths above parameter ``name``, innermost first, the root last."""
    parts = name.split(_SEP)[:-1]
    return [_SEP.join(parts[:i]) for i in range(len(parts), 0, -1)] + [ROOT]


def _check_units(specs: Sequence[ParamSpec], units: Iterable[str]) -> list[str]:
    """The distinct block prefixes, each naming a module that holds parameters."""
    if isinstance(units, str):
        raise TypeError(f"units must be a sequence of module prefixes, not the string {units!r}")
    blocks: dict[str, None] = {}
    names = {s.name for s in specs}
    modules = {path for s in specs for path in _ancestors(s.name)}
    for prefix in units:
        if not isinstance(prefix, str):
            raise TypeError(f"a unit prefix must be a string such as 'layers.0', got {prefix!r}")
        if prefix == ROOT:
            continue  # the root is always a unit; naming it mirrors fully_shard(model)
        if prefix in blocks:
            raise ValueError(f"unit prefix {prefix!r} is listed twice; list each block once")
        if prefix in names:
            raise ValueError(
                f"unit prefix {prefix!r} names a parameter, not a module; "
                f"use its module {_module_of(prefix)!r}"
            )
        if prefix not in modules:
            top = sorted({name.split(_SEP)[0] for name in names if _SEP in name})[:5]
            raise ValueError(
                f"unit prefix {prefix!r} matches no parameter; a unit is a module path such as "
                f"'layers.0' (top-level modules here: {', '.join(top) or 'none'})"
            )
        blocks[prefix] = None
    return list(blocks)


def _post_order(specs: Sequence[ParamSpec]) -> dict[str, int]:
    """Each module path's position in a children-first walk of the module tree.

    The specs are in ``named_parameters()`` order, a parent-first walk, so a module's children
    appear in registration order; FSDP2 collects a unit's parameters walking children first
    (``_get_managed_modules``), and this reproduces that walk from the names alone.
    """
    children: dict[str, list[str]] = {ROOT: []}
    for spec in specs:
        path = ROOT
        for part in _module_of(spec.name).split(_SEP) if _module_of(spec.name) else []:
            child = path + _SEP + part if path else part
            if child not in children:
                children[child] = []
                children[path].append(child)
            path = child
    order: dict[str, int] = {}
    stack: list[tuple[str, bool]] = [(ROOT, False)]
    while stack:  # iterative: module trees can be deeper than Python's recursion limit
        path, expanded = stack.pop()
        if expanded:
            order[path] = len(order)
            continue
        stack.append((path, True))
        stack.extend((child, False) for child in reversed(children[path]))
    return order


def assign_units(
    specs: Sequence[ParamSpec], units: Iterable[str]
) -> tuple[list[str], dict[str, list[str]]]:
    """The unit prefixes in gather order and each one's members in FSDP2's order.

    Prefixes run root first, then in module (forward) order, an outer block before its inner
    one; a parameter belongs to its innermost block (the longest matching prefix, since
    matching prefixes nest). Members follow FSDP2's children-first module walk, then
    registration order within a module.

    Raises:
        ValueError / TypeError: a prefix that names no module, names a parameter, or repeats.
    """
    blocks = set(_check_units(specs, units))
    owner = {s.name: next(p for p in _ancestors(s.name) if p in blocks or p == ROOT) for s in specs}
    first: dict[str, int] = {ROOT: 0}
    for i, spec in enumerate(specs):
        for path in _ancestors(spec.name):
            if path in blocks:
                first.setdefault(path, i)
    prefixes = sorted(first, key=lambda p: (p != ROOT, first[p], len(p)))
    post = _post_order(specs)
    members: dict[str, list[str]] = {prefix: [] for prefix in prefixes}
    walk = sorted(enumerate(specs), key=lambda item: (post[_module_of(item[1].name)], item[0]))
    for _, spec in walk:
        members[owner[spec.name]].append(spec.name)
    return prefixes, members


_NUMBERED = re.compile(r"^\d+$")


def block_prefixes(specs: Iterable[ParamSpec]) -> list[str]:
    """The first numbered module on each parameter's path: one unit per block.

    ``transformer.h.3.attn.c_attn.weight`` -> ``transformer.h.3``, ``layer1.0.conv1.weight``
    -> ``layer1.0``: the entries of a ``ModuleList``/``Sequential`` of blocks, which is what
    torchtitan wraps with ``fully_shard`` one by one. Parameters with no numbered module stay
    in the root. Prefixes come in first-seen order.

    Example:
        >>> block_prefixes([ParamSpec(name=n, shape=(1,)) for n in
        ...                 ["wte.weight", "h.0.ln.weight", "h.0.fc.weight", "h.1.ln.weight"]])
        ['h.0', 'h.1']
    """
    found: dict[str, None] = {}
    for spec in specs:
        parts = _module_of(spec.name).split(_SEP)
        for i, part in enumerate(parts):
            if _NUMBERED.match(part):
                found[_SEP.join(parts[: i + 1])] = None
                break
    return list(found)
