"""Runtime agreement for parameter sharding: ranks that diverge get a sentence, not a hang.

See docs/torch-zero3.md, "Never a hang".

Every collective of a sharded step pairs up by position: rank 0's third all-gather meets rank
1's third all-gather, whatever unit each meant. If one rank gathers its units in another
order, skips a unit, runs a module once more, or leaves a parameter out of its reduce-scatter,
the sizes differ (a hang or a crash inside the backend) or, worse, they match and the ranks
average the wrong rows.

Checking each collective (one 32-byte all-gather before it) costs a blocking rendezvous per
collective, 14 per GPT step. So the ranks check **per phase** instead (forward, backward):

- the first step checks every collective (``agree_on``) and, at each phase's end, the whole
  phase; the phase's collectives, agreed, become its **schedule** (the backward's keyed by
  the units' ``set_requires_gradient_sync``, agreed at the forward's end);
- later steps compare each collective with the schedule locally, without communicating. A
  rank whose collective differs (or that has one more, or one fewer at the phase's end) issues
  **zeros of the schedule's sizes** for the rest of the phase (``Wire.stand_in``), so the
  peers' collectives still meet ones of the same size, never a hang; then the ranks compare
  what they did (one check), and every rank raises the same sentence, naming the first
  collective that differs. If every rank left the schedule the same way (a legitimate change:
  an evaluation forward, accumulation switched on), they go on checking each collective and
  learn the new phase.

So a step costs two checks, not one per collective. The gradients are stored only after the
backward's check (``UnitParameters.store_gradients``): a mismatch is raised before any is.
Under HSDP the reduce-scattered gradients are all-reduced over another group, whose peers a
rank leaving the schedule cannot stand in for alone, so there every collective is checked.
"""

from __future__ import annotations

import hashlib
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

import gradsync_core
from gradsync_torch._collectives import all_gather_single, global_rank, reduce_scatter_single
from gradsync_torch.agreement import Disagreement, agree_on
from gradsync_torch.param_sharding._stall import naming_stalls

_CAP = 1024  # a phase with more collectives (an evaluation loop) is checked one by one


class Wire(NamedTuple):
    """A collective's shape: enough to issue one of the same size in its place."""

    op: str  # "all-gather" or "reduce-scatter"
    group: Any
    numel: int  # elements this rank sends
    dtype: torch.dtype
    device: torch.device
    reduce_op: Any = None

    def stand_in(self, label: str) -> None:
        """Issue this collective with zeros (a rank that left the schedule); ``label``: the
        scheduled collective it stands in for."""
        send = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        size = dist.get_world_size(self.group)
        with naming_stalls(f"{label} (issued with zeros: this rank left the schedule)", self.group):
            if self.op == "all-gather":
                all_gather_single(send.new_empty(size * self.numel), send, group=self.group)
            else:
                out = send.new_empty(self.numel // size)
                reduce_scatter_single(out, send, op=self.reduce_op, group=self.group)


def _what(op: dict[str, Any] | None, phase: str) -> str:
    if op is None:
        return f"the end of their {phase} (no further collective)"
    return f"{op['op']} #{op['seq']} of unit {op['unit']!r} ({len(op['params'])} parameters)"


_FIX = (
    "run the same forward and backward on every rank: the same sharded modules, each called "
    "as often and in the same order, the same set_requires_gradient_sync"
)


def _describe(d: Disagreement, phase: str) -> str:
    mine, theirs = d.base, d.other
    if mine and theirs and mine["unit"] == theirs["unit"] and mine["op"] == theirs["op"]:
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
        detail = (
            f"ranks {d.agreeing} are at {_what(mine, phase)}, ranks {d.differing} at "
            f"{_what(theirs, phase)}"
        )
        fix = _FIX
    return (
        f"fully_shard: the ranks reached different collectives in this step ({detail}); their "
        f"collectives would pair the wrong units and hang or mix their rows; {fix}"
    )


def _sentence(details: list[dict[str, Any]], ranks: list[int]) -> str:
    """The first collective the ranks' logs differ at, or else their next phases."""

    def at(d: dict[str, Any], i: int) -> Any:
        j = i - d["start"]
        return d["log"][j] if 0 <= j < len(d["log"]) else None

    start = max(d["start"] for d in details)
    for i in range(start, max(d["start"] + len(d["log"]) for d in details)):
        ops = [at(d, i) for d in details]
        if any(op != ops[0] for op in ops):
            first = next(r for r, op in enumerate(ops) if op != ops[0])
            agreeing = [ranks[r] for r, op in enumerate(ops) if op == ops[0]]
            differing = [ranks[r] for r, op in enumerate(ops) if op != ops[0]]
            d = Disagreement(ops[0], ops[first], ranks[0], ranks[first], agreeing, differing)
            return _describe(d, details[0]["phase"])
    syncs = {ranks[r]: d["next"] for r, d in enumerate(details)}
    return (
        "fully_shard: the ranks start the backward with different set_requires_gradient_sync "
        f"(per unit, by rank: {syncs}); the ranks would reduce-scatter different units and "
        f"hang or mix their rows; {_FIX}"
    )


def _agree(payload: dict[str, Any], detail: dict[str, Any], group: Any, label: str) -> None:
    """``agree_on`` the payload; on a mismatch gather every rank's ``detail`` (all of them:
    the sentence names each rank's side) and raise the same sentence on every rank.
    ``label``: the check, for the sentence if a rank never reaches it."""
    with naming_stalls(label, group):
        try:
            agree_on(payload, group, describe=lambda d: "", detail=0)
        except ValueError:
            size = dist.get_world_size(group)
            details: list[Any] = [None] * size
            dist.all_gather_object(details, detail, group=group)
            ranks = [global_rank(group, r) for r in range(size)]
            raise ValueError(_sentence(details, ranks)) from None


def _key(entry: dict[str, Any]) -> tuple:
    return entry["op"], entry["unit"], tuple(entry["params"])


class StepAgreement:
    """Numbers this rank's collectives within a step and checks them with its peers: each
    one, or (with a schedule learnt from an agreed phase) once per phase."""

    def __init__(self) -> None:
        self.seq = 0
        self.scheduled: bool | None = None  # set by fully_shard (Step.can_schedule)
        self._phase: Any = "forward"  # "forward", or ("backward", the units' sync flags)
        self._log: list[dict[str, Any]] = []  # this phase's collectives since _start
        self._wires: list[Wire] = []
        self._start = 0  # index in the phase of _log[0]
        self._chain = b""  # digest of the phase's collectives so far
        self._learnable = True
        self._schedules: dict[Any, list[tuple[tuple, Wire]]] = {}
        self._schedule: list[tuple[tuple, Wire]] | None = None  # None: check each

    def _payload(self, entry: Any, nxt: Any) -> tuple[dict[str, Any], dict[str, Any]]:
        phase = self._phase if isinstance(self._phase, str) else "backward"
        at = self._start + len(self._log)
        payload = {"phase": phase, "at": at, "chain": self._chain.hex(), "op": entry, "next": nxt}
        log = self._log + ([entry] if entry is not None else [])
        return payload, {"phase": phase, "start": self._start, "log": log, "next": nxt}

    def _record(self, entry: dict[str, Any], wire: Wire | None) -> None:
        canonical = gradsync_core.canonical_json(entry).encode("utf-8")
        self._chain = hashlib.sha256(self._chain + canonical).digest()
        if len(self._log) >= _CAP or wire is None:  # too long to learn: keep checking each
            self._learnable = False
            self._start += len(self._log)
            self._log, self._wires = [], []
        self._log.append(entry)
        self._wires.append(wire)  # type: ignore[arg-type]

    def check(
        self, op: str, unit: str, params: list[str], group: Any, wire: Wire | None = None
    ) -> str:
        """Before collective ``op`` for ``unit`` over ``params``: raise the same
        ``ValueError`` on every rank of ``group`` unless all are about to run it. Returns the
        collective's label, e.g. ``"all-gather #5 of unit 'b' (4 parameters)"``."""
        self.seq += 1
        entry = {"op": op, "seq": self.seq, "unit": unit or "<root>", "params": params}
        label = _what(entry, "")
        check = f"the agreement check before {label}"
        if not self.scheduled:  # each collective on its own; no log to keep
            _agree(*self._payload(entry, None), group, check)
            return label
        if self._phase == "forward" and not torch.is_grad_enabled():
            self._learnable = False  # an evaluation forward: no schedule for the training one
        schedule = self._schedule
        if schedule is None:
            _agree(*self._payload(entry, None), group, check)
        elif len(self._log) >= len(schedule) or schedule[len(self._log)][0] != _key(entry):
            self._leave(len(self._log), group, entry, label=check)
        self._record(entry, wire)
        return label

    def _leave(self, done: int, group: Any, entry: Any, nxt: Any = None, *, label: str) -> None:
        """This rank left the schedule after ``done`` collectives: stand in for the rest,
        then compare with the peers (who stood in alike, or reach the phase's end check)."""
        assert self._schedule is not None
        for (op, unit, params), wire in self._schedule[done:]:
            wire.stand_in(f"{op} of unit {unit!r} ({len(params)} parameters)")
        self._schedule = None
        _agree(*self._payload(entry, nxt), group, label)

    def end_phase(self, nxt: Any, group: Any) -> None:
        """The phase ended (the backward starts: ``nxt`` is ``("backward", sync flags)``; or
        it ended: ``"forward"``). Check the phase with the peers and learn it as a schedule."""
        if self.scheduled:
            phase = "forward" if self._phase == "forward" else "backward"
            after = f" (after {_what(self._log[-1], phase)})" if self._log else ""
            label = f"the agreement check at the end of the {phase}{after}"
            if self._schedule is not None and len(self._log) < len(self._schedule):
                self._leave(len(self._log), group, None, _jsonable(nxt), label=label)
            else:
                _agree(*self._payload(None, _jsonable(nxt)), group, label)
            if self._learnable and self._start == 0:
                self._schedules[self._phase] = [
                    (_key(e), w) for e, w in zip(self._log, self._wires, strict=True)
                ]
            else:
                self._schedules.pop(self._phase, None)
        self._phase, self._schedule = nxt, self._schedules.get(nxt)
        self._log, self._wires, self._start, self._chain = [], [], 0, b""
        self._learnable = True
        if nxt == "forward":
            self.seq = 0


def _jsonable(key: Any) -> Any:
    return list(key[1]) if isinstance(key, tuple) else key
