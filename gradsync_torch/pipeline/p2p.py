"""Point-to-point messages between pipeline stages, shapes agreed at the first step.

A forward sends a stage's outputs to the next stage's rank, a backward their gradients back.
Shapes are not declared up front: at the first step the sender of each edge (stage s - 1 to
stage s) sends a small metadata tensor (status, stage, every tensor's dtype, shape and whether
it needs a gradient) on a separate gloo group, just before the edge's first activation; its
receiver posts the activation's receive once the metadata is in, which it learns when it
waits for it (a gloo receive's ``is_completed()`` stays false until ``wait()``, so it cannot
be polled): at the first step a receive is posted when its compute needs it. Messages
between two ranks match in the order they are posted, so a receive that waits for its
metadata holds back every later receive from the same peer (a queue per peer): the order the
plan checked is kept. After the first step both sides know every edge's shapes; a sender
whose output then has other shapes does not send it (the receiver would read garbage or wait
forever) but reports it, and sends zeros of the agreed shapes instead, as a failed stage does
(``runtime.py``): every message of the plan is still sent and received, so no rank waits on
one that never comes, and the step ends with one sentence on every rank.

Gradients need no metadata: a stage's output gradients have its outputs' shapes. Sends are
asynchronous and waited for at the end of the step (torch's runtime); consecutive
communication actions of a rank go out together, through ``batch_isend_irecv`` when they mix
sends and receives (torch's ``_batch_p2p``). On gloo the runtime posts every receive of the
step at its start (``early``), in the plan's order.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

OK, DEAD = 1, 2  # metadata status: the edge's shapes follow / its sender failed first
META_LEN = 64  # int64 elements of one metadata message
_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
    torch.complex128,
)


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor of a message."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool

    @property
    def has_grad(self) -> bool:
        """Whether a gradient travels back for it."""
        return self.requires_grad and (self.dtype.is_floating_point or self.dtype.is_complex)

    def __str__(self) -> str:
        return f"{tuple(self.shape)} {str(self.dtype).removeprefix('torch.')}"


Metas = tuple[TensorMeta, ...]


def metas_of(tensors: Sequence[torch.Tensor]) -> Metas:
    return tuple(TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in tensors)


def describe_metas(metas: Metas) -> str:
    return ", ".join(map(str, metas)) if metas else "no tensors"


def encode(stage: int, metas: Metas | None) -> torch.Tensor:
    """One metadata message: ``[status, stage, count, (dtype, grad, ndim, *dims)...]``.

    Raises:
        ValueError: for a dtype that cannot travel or more tensors or dimensions than fit.
    """
    if metas is None:
        return torch.tensor([DEAD, stage] + [0] * (META_LEN - 2), dtype=torch.int64)
    words = [OK, stage, len(metas)]
    for meta in metas:
        if meta.dtype not in _DTYPES:
            raise ValueError(f"a stage output of dtype {meta.dtype} cannot be sent")
        words += [_DTYPES.index(meta.dtype), int(meta.requires_grad), len(meta.shape)]
        words += list(meta.shape)
    if len(words) > META_LEN:
        raise ValueError(
            f"a stage's outputs ({describe_metas(metas)}) need {len(words)} words of metadata, "
            f"more than the {META_LEN} a message holds; return fewer tensors or dimensions"
        )
    return torch.tensor(words + [0] * (META_LEN - len(words)), dtype=torch.int64)


def decode(message: torch.Tensor) -> tuple[int, int, Metas | None]:
    """``(status, stage, metas)``; ``metas`` is ``None`` for a dead edge."""
    words = message.tolist()
    status, stage = words[0], words[1]
    if status != OK:
        return status, stage, None
    metas, at = [], 3
    for _ in range(words[2]):
        dtype, grad, ndim = words[at : at + 3]
        shape = tuple(words[at + 3 : at + 3 + ndim])
        metas.append(TensorMeta(shape, _DTYPES[dtype], bool(grad)))
        at += 3 + ndim
    return status, stage, tuple(metas)


@dataclass(slots=True)
class _Receive:
    """A receive the plan posted: its key, the edge its shapes come from, its buffers."""

    kind: str  # "F" (activations into stage ``edge``) or "B" (their gradients, back)
    edge: int
    mb: int
    tensors: list[torch.Tensor] = field(default_factory=list)
    works: list[Any] = field(default_factory=list)
    dead: bool = False
    posted: bool = False


class Messages:
    """One pipeline rank's point-to-point traffic for a step, edge metadata across steps.

    Edge ``e`` carries stage ``e - 1``'s outputs to stage ``e`` (and their gradients back);
    only edges whose stages sit on two ranks have messages.

    Args:
        group: the pipeline group (gloo or NCCL).
        meta_group: a gloo group over the same ranks, for the metadata.
        stage_ranks: each stage's place in the pipeline group.
        device: where activations live.
    """

    def __init__(
        self,
        group: dist.ProcessGroup,
        meta_group: dist.ProcessGroup,
        stage_ranks: Sequence[int],
        device: torch.device,
    ) -> None:
        self.group, self.meta_group = group, meta_group
        self.ranks = tuple(stage_ranks)
        self.device = device
        self.meta: dict[int, Metas] = {}  # edge -> agreed shapes (kept across steps)
        self.dead: set[int] = set()  # edges whose sender failed before their first message
        self._meta_recvs: dict[int, tuple[Any, torch.Tensor]] = {}
        self._meta_sends: list[Any] = []
        self._sends: list[Any] = []
        self._receives: dict[tuple[str, int, int], _Receive] = {}
        self._queues: dict[int, deque[_Receive]] = {}  # per peer: receives not posted yet
        self._ops: list[tuple[dist.P2POp, _Receive | None]] = []
        # gloo runs each send and receive on its own, so a receive posted early delays
        # nothing; NCCL queues them on one stream, where a receive posted ahead of the
        # plan could hold back the send its peer waits for.
        self.early = dist.get_backend(group) == "gloo"

    # ---- posting (batched until ``issue``) ---------------------------------------------

    def send_forward(self, stage: int, mb: int, outputs: Sequence[torch.Tensor] | None) -> None:
        """Send ``stage``'s outputs for ``mb``; ``None``: this rank failed, send zeros of the
        agreed shapes (or, before any were agreed, a dead edge's metadata)."""
        edge = stage + 1
        if edge not in self.meta and edge not in self.dead:
            metas = None if outputs is None else metas_of(outputs)
            work = dist.isend(
                encode(edge, metas), group=self.meta_group, group_dst=self.ranks[edge]
            )
            self._meta_sends.append(work)
            if metas is None:
                self.dead.add(edge)
            else:
                self.meta[edge] = metas
        if edge in self.dead:
            return
        if outputs is None:
            outputs = [
                torch.zeros(m.shape, dtype=m.dtype, device=self.device) for m in self.meta[edge]
            ]
        for tensor in outputs:
            op = dist.P2POp(
                dist.isend, tensor.detach(), group=self.group, group_peer=self.ranks[edge]
            )
            self._ops.append((op, None))

    def send_backward(
        self, stage: int, mb: int, grads: Sequence[torch.Tensor | None] | None
    ) -> None:
        """Send the gradients of ``stage``'s inputs for ``mb`` back (``None``: zeros)."""
        edge = stage
        if edge not in self.meta and edge not in self.dead:
            # This rank failed before reading the edge's metadata (posted with the
            # activations' receive): read it now, the shapes of the zeros to send.
            self._take_meta(edge)
        if edge in self.dead:
            return
        metas = [m for m in self.meta[edge] if m.has_grad]
        if grads is None:
            grads = [None] * len(self.meta[edge])
        sent = [g for g, m in zip(grads, self.meta[edge], strict=True) if m.has_grad]
        for grad, meta in zip(sent, metas, strict=True):
            if grad is None:
                grad = torch.zeros(meta.shape, dtype=meta.dtype, device=self.device)
            op = dist.P2POp(dist.isend, grad, group=self.group, group_peer=self.ranks[edge - 1])
            self._ops.append((op, None))

    def post_forward(self, stage: int, mb: int) -> None:
        """Post the receive of ``stage``'s inputs for ``mb``."""
        edge = stage
        if edge not in self.meta and edge not in self.dead and edge not in self._meta_recvs:
            buffer = torch.empty(META_LEN, dtype=torch.int64)
            work = dist.irecv(buffer, group=self.meta_group, group_src=self.ranks[edge - 1])
            self._meta_recvs[edge] = (work, buffer)
        self._post(_Receive("F", edge, mb), self.ranks[edge - 1])

    def post_backward(self, stage: int, mb: int) -> None:
        """Post the receive of the gradients of ``stage``'s outputs for ``mb``."""
        self._post(_Receive("B", stage + 1, mb), self.ranks[stage + 1])

    def _post(self, receive: _Receive, peer: int) -> None:
        key = (receive.kind, receive.edge, receive.mb)
        if key in self._receives:
            raise RuntimeError(f"the receive {key} is posted twice in one step")
        self._receives[key] = receive
        self._queues.setdefault(peer, deque()).append(receive)
        self._flush(peer, block=False)

    def _flush(self, peer: int, *, block: bool) -> None:
        """Post the peer's queued receives in order, as far as their shapes are known
        (``block``: wait for the head's metadata first)."""
        queue = self._queues[peer]
        while queue:
            head = queue[0]
            if head.edge not in self.meta and head.edge not in self.dead:
                if not block:
                    return
                self._take_meta(head.edge)
                block = False
            queue.popleft()
            head.posted = True
            if head.edge in self.dead:
                head.dead = True
                continue
            metas = self.meta[head.edge]
            if head.kind == "B":
                metas = tuple(m for m in metas if m.has_grad)
            for meta in metas:
                buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.device)
                head.tensors.append(buffer)
                self._ops.append(
                    (dist.P2POp(dist.irecv, buffer, group=self.group, group_peer=peer), head)
                )

    def _take_meta(self, edge: int) -> None:
        """Wait for the edge's metadata and keep its shapes (or mark the edge dead)."""
        work, buffer = self._meta_recvs[edge]
        work.wait()
        del self._meta_recvs[edge]
        _, stage, metas = decode(buffer)
        if stage != edge:
            raise RuntimeError(
                f"metadata for stage {stage} arrived where stage {edge}'s was expected; the "
                "ranks run different plans"
            )
        if metas is None:
            self.dead.add(edge)
        else:
            self.meta[edge] = metas

    def issue(self) -> None:
        """Start everything posted since the last call, together (torch's ``_batch_p2p``)."""
        ops, self._ops = self._ops, []
        if not ops:
            return
        kinds = {op.op for op, _ in ops}
        works: Sequence[dist.Work | None]
        if len(kinds) == 1:  # all sends or all receives: each on its own, as torch does
            works = [
                dist.isend(op.tensor, group=op.group, group_dst=op.group_peer)
                if op.op is dist.isend
                else dist.irecv(op.tensor, group=op.group, group_src=op.group_peer)
                for op, _ in ops
            ]
        else:
            works = dist.batch_isend_irecv([op for op, _ in ops])
        for (_, receive), work in zip(ops, works, strict=True):
            if receive is None:
                self._sends.append(work)
            else:
                receive.works.append(work)

    # ---- waiting ---------------------------------------------------------------------

    def wait(self, kind: str, edge: int, mb: int) -> list[torch.Tensor] | None:
        """The tensors of a posted receive once they are in; ``None`` on a dead edge."""
        receive = self._receives.pop((kind, edge, mb))
        peer = self.ranks[edge - 1] if kind == "F" else self.ranks[edge]
        while not receive.posted:
            self._flush(peer, block=True)
        self.issue()
        for work in receive.works:
            work.wait()
        if receive.dead:
            return None
        if kind == "F":
            for tensor, meta in zip(receive.tensors, self.meta[edge], strict=True):
                tensor.requires_grad_(meta.has_grad)
        return receive.tensors

    def finish(self) -> None:
        """End the step: every receive drained (a failed step leaves some unread), every
        send complete."""
        for peer in list(self._queues):
            while self._queues[peer]:
                self._flush(peer, block=True)
        self.issue()
        for receive in self._receives.values():
            for work in receive.works:
                work.wait()
        self._receives.clear()
        for work in self._sends + self._meta_sends:
            work.wait()
        self._sends, self._meta_sends = [], []
        self.dead.clear()
