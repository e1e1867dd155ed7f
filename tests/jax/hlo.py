"""Reading compiled XLA programs: which collectives run inside loops."""

from __future__ import annotations

import re


def _computations(hlo: str) -> dict[str, str]:
    """Compiled HLO text -> {computation name: body text}."""
    blocks = re.split(r"\n(?=(?:ENTRY )?%[\w.\-]+ )", hlo)
    named = {}
    for block in blocks:
        match = re.match(r"(?:ENTRY )?%([\w.\-]+) ", block)
        if match:
            named[match.group(1)] = block
    return named


def collectives_in_loops(hlo: str) -> tuple[int, int, int]:
    """(all-reduces in the program, while loops, all-reduces reachable from a loop body)."""
    comps = _computations(hlo)
    pattern = r"(?:body|condition|calls|to_apply|branch_computations)=\{?%([\w.\-]+)"
    bodies = re.findall(r"while\(.*?body=%([\w.\-]+)", hlo)
    seen, todo = set(), list(bodies)
    while todo:
        name = todo.pop()
        if name not in seen and name in comps:
            seen.add(name)
            todo += re.findall(pattern, comps[name])
    count = len(re.findall(r"all-reduce(?:-start)?\(", hlo))
    in_loops = sum(len(re.findall(r"all-reduce(?:-start)?\(", comps[n])) for n in seen)
    return count, len(bodies), in_loops
