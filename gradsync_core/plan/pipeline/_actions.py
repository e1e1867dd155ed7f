"""The pipeline action grammar: torch's ``2F0``, ``1SEND_F3``, ``0REDUCE_GRAD`` (docs/pipeline.md).

One action is what one rank does next: compute a stage on a microbatch, move an activation or
its gradient between ranks, or act on a stage's parameters and gradients. The spelling is
``torch.distributed.pipelining.schedules._Action``'s, read and written unchanged, so a plan's
CSV loads into torch's ``_PipelineScheduleRuntime`` and torch's CSVs load here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

FORWARD = "F"
FULL_BACKWARD = "B"
BACKWARD_INPUT = "I"  # zero bubble's input-gradient half (arXiv:2401.10241's "B")
BACKWARD_WEIGHT = "W"  # ... and its weight-gradient half, deferred into the bubbles
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
UNSHARD, RESHARD = "UNSHARD", "RESHARD"  # ZeRO-3: gather a stage's parameters, free them
REDUCE_GRAD = "REDUCE_GRAD"  # the stage's gradients are final: reduce them over data parallel
OVERLAP_F_B = "OVERLAP_F_B"  # DualPipeV: a forward and a backward of two chunks, run together

COMPUTE = (FORWARD, FULL_BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COMMS = (SEND_F, RECV_F, SEND_B, RECV_B)
STAGE_ONLY = (UNSHARD, RESHARD, REDUCE_GRAD)  # spelled without a microbatch
KINDS = COMPUTE + COMMS + STAGE_ONLY + (OVERLAP_F_B,)

# torch's alternation, anchored at both ends: torch's own ``match`` would read "0F1x" as 0F1.
_ACTION = re.compile(r"(\d+)(F|I|B|W|UNSHARD|RESHARD|REDUCE_GRAD|SEND_F|RECV_F|SEND_B|RECV_B)(\d*)")
_OVERLAP = re.compile(r"\(([^()]*)\)" + OVERLAP_F_B)


# Positional like torch's ``_Action(stage_index, computation_type, microbatch_index)``: the
# schedules build thousands of them and read best in torch's own order.
@dataclass(frozen=True, slots=True)
class Action:
    """One step of one rank: ``Action(2, "F", 0)`` is torch's ``2F0``.

    Args:
        stage: the stage it acts on (-1 for an ``OVERLAP_F_B`` container, as torch's).
        kind: one of ``KINDS``.
        microbatch: the microbatch; ``None`` for ``UNSHARD``, ``RESHARD``, ``REDUCE_GRAD``
            and ``OVERLAP_F_B``.
        parts: an ``OVERLAP_F_B``'s forward and backward, run in this order; empty otherwise.

    Example:
        >>> str(Action(1, "SEND_F", 3)), Action.parse("(0F3;3B1)OVERLAP_F_B").parts[1]
        ('1SEND_F3', Action(stage=3, kind='B', microbatch=1, parts=()))
    """

    stage: int
    kind: str
    microbatch: int | None = None
    parts: tuple[Action, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; kinds are {', '.join(KINDS)}")
        if self.kind == OVERLAP_F_B:
            if self.stage != -1 or self.microbatch is not None or len(self.parts) != 2:
                raise ValueError(
                    "an OVERLAP_F_B action holds exactly two compute actions (a forward, then a "
                    f"backward) and no stage or microbatch of its own, got {self!r}"
                )
            forward, backward = self.parts
            if forward.kind != FORWARD or backward.kind not in (FULL_BACKWARD, BACKWARD_INPUT):
                raise ValueError(
                    f"an OVERLAP_F_B action runs a forward then a backward, got "
                    f"({forward};{backward})"
                )
            return
        if self.parts:
            raise ValueError(f"only OVERLAP_F_B actions have parts, not {self.kind}")
        if not isinstance(self.stage, int) or self.stage < 0:
            raise ValueError(f"a {self.kind} action needs a stage index >= 0, got {self.stage!r}")
        if (self.kind in STAGE_ONLY) != (self.microbatch is None):
            need = "no microbatch" if self.kind in STAGE_ONLY else "a microbatch"
            raise ValueError(f"a {self.kind} action takes {need}, got {self.microbatch!r}")
        if self.microbatch is not None and self.microbatch < 0:
            raise ValueError(f"a microbatch index is >= 0, got {self.microbatch}")

    def __str__(self) -> str:
        if self.kind == OVERLAP_F_B:
            return "(" + ";".join(map(str, self.parts)) + ")" + OVERLAP_F_B
        mb = "" if self.microbatch is None else str(self.microbatch)
        return f"{self.stage}{self.kind}{mb}"

    @property
    def is_compute(self) -> bool:
        """Forward, backward (full or either half) or an overlapped pair: torch's
        ``is_compute_op``."""
        return self.kind in COMPUTE or self.kind == OVERLAP_F_B

    @property
    def leaves(self) -> tuple[Action, ...]:
        """The actions a rank runs for this one: an ``OVERLAP_F_B``'s parts, else itself."""
        return self.parts if self.kind == OVERLAP_F_B else (self,)

    @classmethod
    def parse(cls, text: str) -> Action:
        """The action torch spells ``text`` (``"2F0"``, ``"1SEND_F3"``, ``"(0F3;3B1)OVERLAP_F_B"``).

        Raises:
            ValueError: if ``text`` is not one action in torch's grammar.
        """
        text = text.strip()
        if m := _OVERLAP.fullmatch(text):
            return cls(-1, OVERLAP_F_B, None, tuple(cls.parse(p) for p in m.group(1).split(";")))
        m = _ACTION.fullmatch(text)
        if m is None:
            raise ValueError(
                f"cannot read action {text!r}: torch's grammar is [stage][kind][microbatch], "
                "e.g. 2F0, 1SEND_F3, 0REDUCE_GRAD or (0F3;3B1)OVERLAP_F_B"
            )
        stage, kind, mb = m.groups()
        return cls(int(stage), kind, int(mb) if mb else None)
