"""Runtime agreement for parameter sharding: ranks that run differently get a sentence, not a
hang (docs/torch-zero3.md, "Never a hang").

Every collective of a sharded step pairs up by position: rank 0's third all-gather meets rank
1's third all-gather, whatever unit each meant. If one rank gathers its units in another
order, skips a unit, runs a module once more, or leaves a parameter out of its reduce-scatter,
the sizes differ (a hang or a crash inside the backend) or, worse, they match and the ranks
average the wrong rows. So before each collective the ranks compare what they are about to
do (``agree_on``: one 32-byte all-gather on the same group); only when it differs are the full
descriptions gathered, and every rank raises the same sentence naming the unit, the
collective and the ranks on each side.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from gradsync_torch.agreement import Disagreement, agree_on


def _what(op: dict[str, Any]) -> str:
    return f"{op['op']} #{op['seq']} of unit {op['unit']!r} ({len(op['params'])} parameters)"


def _describe(d: Disagreement) -> str:
    mine, theirs = d.base, d.other
    if mine["unit"] == theirs["unit"] and mine["op"] == theirs["op"]:
        ours, others = set(mine["params"]), set(theirs["params"])
        sides = [(ours - others, d.agreeing, d.differing), (others - ours, d.differing, d.agreeing)]
        detail = f"both are at {mine['op']} #{mine['seq']} of unit {mine['unit']!r}, but " + (
            " and ".join(
                f"parameters {sorted(names)} have a gradient on ranks {has} and not on ranks "
                f"{lacks}"
                for names, has, lacks in sides
                if names
            )
        )
        fix = (
            "use every parameter of a unit in every step on every rank (or freeze it on all), "
            "as FSDP2 requires"
        )
    else:
        detail = f"ranks {d.agreeing} are at {_what(mine)}, ranks {d.differing} at {_what(theirs)}"
        fix = (
            "run the same forward and backward on every rank: the same sharded modules, each "
            "called as often and in the same order, the same set_requires_gradient_sync"
        )
    return (
        f"fully_shard: the ranks reached different collectives in this step ({detail}); their "
        f"collectives would pair the wrong units and hang or mix their rows; {fix}"
    )


class StepAgreement:
    """Numbers this rank's collectives within a step and checks each with its peers."""

    def __init__(self) -> None:
        self.seq = 0

    def check(self, op: str, unit: str, params: list[str], group: dist.ProcessGroup | None) -> None:
        """Raise the same ``ValueError`` on every rank of ``group`` unless all are about to run
        collective ``op`` for ``unit`` over the same ``params``."""
        self.seq += 1
        payload = {"op": op, "seq": self.seq, "unit": unit or "<root>", "params": params}
        agree_on(payload, group, describe=_describe)

    def new_step(self) -> None:
        """The backward ended: number the next step's collectives from 1 again."""
        self.seq = 0
