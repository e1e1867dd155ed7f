"""One unit's parameters: sharded at rest, gathered around its use, gradients reduce-scattered
(ZeRO-3, arXiv:1910.02054 §5.3). The hooks (``_hooks.py``) decide *when*; this owns *what*.

The representation is FSDP2's (torch 2.13 ``_fsdp_param.py``), so torch's tools work on it:
each parameter is an ``nn.Parameter`` holding a ``DTensor`` with ``Shard(0)`` whose local
tensor is the *unpadded* view of a zero-padded chunk (the plan's ``ParamChunk``); gathered, it
is a plain ``nn.Parameter`` viewing a buffer whose storage is freed (resized to 0) when
resharded, so autograd's saved tensors see the next gather's data without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Shard

from gradsync_core import ParamChunk
from gradsync_torch._collectives import all_gather_single, reduce_scatter_single
from gradsync_torch.param_sharding._agreement import Wire
from gradsync_torch.param_sharding._divide import gradient_divide
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy


@dataclass(slots=True, kw_only=True)
class ShardedParameter:
    """One parameter's three forms: padded local storage, the DTensor the optimizer sees, and
    the gathered tensor forward and backward use."""

    name: str  # the path inside the module fully_shard was called on
    places: tuple[tuple[nn.Module, str], ...]  # (module, attribute) holding it; 2+ if tied
    chunks: tuple[ParamChunk, ...]  # every shard rank's rows, from the plan
    shard_rank: int
    padded: torch.Tensor  # flat, chunk.padded_numel elements, zero past the held rows
    sharded: nn.Parameter  # DTensor(Shard(0)) viewing padded's first chunk.numel elements
    gathered: torch.Tensor  # flat, world_size * chunk.padded_numel, storage freed at rest
    unsharded: nn.Parameter  # gathered viewed in the parameter's shape
    accumulated: torch.Tensor | None = None  # unsynced gradients kept in the reduce dtype

    @property
    def chunk(self) -> ParamChunk:
        """This rank's rows."""
        return self.chunks[self.shard_rank]


def _setattr(module: nn.Module, attr: str, param: nn.Parameter) -> None:
    # Swap without nn.Module.__setattr__'s checks, as FSDP2 does: the same name must point
    # at the gathered parameter in forward and at the sharded one at rest.
    module._parameters[attr] = param


def _free(tensor: torch.Tensor) -> None:
    if tensor.untyped_storage().size() != 0:
        tensor.untyped_storage().resize_(0)


def _alloc(tensor: torch.Tensor) -> None:
    nbytes = tensor.numel() * tensor.itemsize
    if tensor.untyped_storage().size() != nbytes:
        tensor.untyped_storage().resize_(nbytes)


def _release(*buffers: torch.Tensor) -> None:
    """Free a finished collective's buffers now. Dropping our references is not enough: the
    backend's work object holds them until its thread lets go of it, which on an
    oversubscribed machine came after the next unit's backward had started (measured: the
    root's all-gather buffers, 41 MB at 4 ranks, alive into the backward on half the ranks)."""
    for buffer in buffers:
        _free(buffer)


def _swap(places: tuple[tuple[nn.Module, str], ...], param: nn.Parameter) -> None:
    for module, attr in places:
        _setattr(module, attr, param)


def shard_parameter(
    name: str,
    places: tuple[tuple[nn.Module, str], ...],
    chunks: tuple[ParamChunk, ...],
    shard_rank: int,
    mesh: DeviceMesh,
    gather_dtype: torch.dtype | None,
    placements: tuple[Placement, ...] = (Shard(0),),
) -> ShardedParameter:
    """Replace the parameter at ``places`` by this rank's rows (``chunks[shard_rank]``) as a
    ``DTensor`` on ``mesh`` with ``placements`` (``(Replicate(), Shard(0))`` under HSDP, as
    FSDP2's); a tied parameter is held at several places and swapped at all of them."""
    chunk = chunks[shard_rank]
    module, attr = places[0]
    full = module._parameters[attr]
    assert full is not None
    data = full.detach()
    padded = data.new_zeros(chunk.padded_numel)
    padded[: chunk.numel].copy_(data[chunk.start : chunk.stop].reshape(-1))
    local = padded[: chunk.numel].view(chunk.local_shape)
    shape = torch.Size(chunk.shape)
    # Mixed precision applies to floating parameters only, as in FSDP2's init_dtype_attrs.
    dtype = gather_dtype if gather_dtype and data.is_floating_point() else data.dtype
    gathered = torch.empty(len(chunks) * chunk.padded_numel, dtype=dtype, device=data.device)
    view = gathered[: full.numel()].view(shape)
    unsharded = nn.Parameter(view, requires_grad=full.requires_grad)
    sharded = nn.Parameter(  # the global shape with contiguous strides, as FSDP2's
        DTensor.from_local(
            local, mesh, placements, run_check=False, shape=shape, stride=view.stride()
        ),
        requires_grad=full.requires_grad,
    )
    _free(gathered)
    _swap(places, sharded)
    return ShardedParameter(
        name=name,
        places=places,
        chunks=chunks,
        shard_rank=shard_rank,
        padded=padded,
        sharded=sharded,
        gathered=gathered,
        unsharded=unsharded,
    )


class UnitParameters:
    """The parameters of one unit and the three moves on them: gather, free, reduce."""

    def __init__(
        self,
        params: list[ShardedParameter],
        *,
        group: dist.ProcessGroup,
        world_size: int,
        policy: MixedPrecisionPolicy,
        replicate_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.params = params
        self.group = group
        self.world_size = world_size
        # HSDP: the reduce-scattered shards are all-reduced over the replicate group, and the
        # mean is over both (FSDP2's data_parallel_size = shard size x replicate size).
        self.replicate_group = replicate_group
        self.replicate_size = 1 if replicate_group is None else replicate_group.size()
        # FSDP2 drops a reduce dtype equal to the compute dtype: nothing to cast.
        same = policy.reduce_dtype == policy.param_dtype
        self.reduce_dtype = None if same else policy.reduce_dtype
        self.is_gathered = False
        self._gathering: tuple | None = None  # an all-gather in flight (a prefetch)
        self._pending: tuple | None = None  # a reduce-scatter in flight
        self._all_reducing: tuple | None = None  # HSDP: its all-reduce over the replicas
        # Reduced gradients waiting for the end-of-backward agreement check before they are
        # stored (store_gradients): a step the ranks ran differently changes no gradient.
        self._reduced: list[tuple[ShardedParameter, torch.Tensor]] = []
        # Called with (collective, member names) before each collective: the hooks' runtime
        # agreement (_agreement.py), so ranks that diverge get a sentence, not a hang.
        self.check: Callable[..., None] | None = None

    def start_gather(self) -> None:
        """Start all-gathering every member (frozen ones too) in one collective, in the
        background (a prefetch: ``gather`` finishes it when the unit is needed)."""
        if self.is_gathered or self._gathering is not None or not self.params:
            return
        dtype = self.params[0].gathered.dtype
        if self.check is not None:
            numel = sum(p.chunk.padded_numel for p in self.params)
            device = self.params[0].padded.device
            wire = Wire("all-gather", self.group, numel, dtype, device)
            self.check("all-gather", [p.name for p in self.params], wire=wire)
        send = torch.cat([p.padded.to(dtype) for p in self.params])
        recv = send.new_empty(self.world_size * send.numel())
        work = all_gather_single(recv, send, group=self.group, async_op=True)
        self._gathering = (work, recv, send)

    def gather(self) -> None:
        """Gather the unit (or finish the gather ``start_gather`` began) and swap it in."""
        if self.is_gathered or not self.params:
            self.is_gathered = True
            return
        self.start_gather()
        assert self._gathering is not None
        work, recv, send = self._gathering
        self._gathering = None
        work.wait()
        pieces = recv.view(self.world_size, -1).split(
            [p.chunk.padded_numel for p in self.params], 1
        )
        for p, piece in zip(self.params, pieces, strict=True):
            _alloc(p.gathered)
            # Autograd saved the gathered tensors in an earlier forward; refilling them in
            # place is the point, so the version counter must not change (as in FSDP2).
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p.gathered):
                p.gathered.view(self.world_size, -1).copy_(piece)
            if p.unsharded.requires_grad != p.sharded.requires_grad:
                p.unsharded.requires_grad_(p.sharded.requires_grad)
            _swap(p.places, p.unsharded)
        _release(recv, send)
        self.is_gathered = True

    @property
    def is_gathering(self) -> bool:
        """Whether a prefetch's all-gather is in flight."""
        return self._gathering is not None

    def free(self) -> None:
        """Point the modules back at the shards and release the gathered storage."""
        if self._gathering is not None:  # a prefetch nobody used: complete it, then drop it
            work, *buffers = self._gathering
            work.wait()
            _release(*buffers)
            self._gathering = None
        if not self.is_gathered:
            return
        for p in self.params:
            _swap(p.places, p.sharded)
            _free(p.gathered)
        self.is_gathered = False

    def reduce_gradients(self) -> None:
        """Start reduce-scattering the gathered gradients into the sharded ``.grad``s.

        The collective runs in the background (gloo's threads, NCCL's stream) while autograd
        goes on with the units before this one; ``finish_reduce`` waits for it and hands the
        gradients over. The send buffer is FSDP2's layout (``_send_buffer``), and the
        collective and its arithmetic are FSDP2's (``_divide.py``), so the sums are its bytes.
        """
        self.finish_reduce()
        self._fold_accumulated()
        ready = [
            p for p in self.params if p.accumulated is not None or p.unsharded.grad is not None
        ]
        if not ready:
            return
        reduce_dtype = self.reduce_dtype or _gradient(ready[0]).dtype
        send = _send_buffer(ready, self.world_size, reduce_dtype)
        out = send.new_empty(send.shape[1])
        divide = gradient_divide(reduce_dtype, self.world_size * self.replicate_size)
        if divide.pre not in (None, 1):
            send.div_(divide.pre)
        work = None
        if self.check is not None:
            wire = Wire("reduce-scatter", self.group, send.numel(), reduce_dtype, send.device)
            self.check(
                "reduce-scatter", [p.name for p in ready], wire=wire._replace(reduce_op=divide.op)
            )
        if self.world_size > 1:
            # FSDP2's own collective and op (AVG for float32/bfloat16), not the executor's
            # SUM-only reduce_scatter_into: bitwise parity with FSDP2 needs the same reduction.
            work = reduce_scatter_single(
                out, send.view(-1), op=divide.op, group=self.group, async_op=True
            )
        else:
            out.copy_(send.view(-1))
        self._pending = (work, send, out, ready, divide)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter ``reduce_gradients`` started; store the gradients, or
        under HSDP start their all-reduce over the replicas (``finish_all_reduce`` ends it)."""
        if self._pending is None:
            return
        work, send, out, ready, divide = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        _release(send)  # before the gradients' views are made: the peak is one unit's, not two
        if self.replicate_size > 1:
            if self.check is not None:
                self.check("all-reduce", [p.name for p in ready], group=self.replicate_group)
            work = dist.all_reduce(out, op=divide.op, group=self.replicate_group, async_op=True)
            self._all_reducing = (work, out, ready, divide.post)
            return
        self._reduced += _reduced(ready, out, divide.post)

    def finish_all_reduce(self) -> None:
        """Wait for the HSDP all-reduce ``finish_reduce`` started; store the gradients."""
        if self._all_reducing is None:
            return
        work, out, ready, post = self._all_reducing
        self._all_reducing = None
        work.wait()
        self._reduced += _reduced(ready, out, post)

    def store_gradients(self) -> None:
        """Hand the reduced gradients to the sharded ``.grad``s (added to any already there,
        as FSDP2 accumulates across steps); called once the step's collectives agreed."""
        reduced, self._reduced = self._reduced, []
        for p, local in reduced:
            grad = p.sharded.grad
            if grad is not None:
                grad._local_tensor += local
            else:
                p.sharded.grad = DTensor.from_local(
                    local,
                    p.sharded.device_mesh,
                    p.sharded.placements,
                    run_check=False,
                    shape=p.sharded.shape,
                    stride=p.sharded.stride(),
                )

    def keep_gradients(self) -> None:
        """Gradient sync is off: leave the gradients unsharded for the next backward to add
        to, in the reduce dtype when one is set (FSDP2's ``to_accumulated_grad_if_needed``)."""
        self._fold_accumulated()
        for p in self.params:
            grad = p.unsharded.grad
            if (
                self.reduce_dtype is not None
                and grad is not None
                and grad.dtype != self.reduce_dtype
            ):
                p.unsharded.grad = None
                p.accumulated = grad.to(self.reduce_dtype)

    def _fold_accumulated(self) -> None:
        # FSDP2's accumulate_unsharded_grad_if_needed: this backward's gradient joins the sum.
        for p in self.params:
            if p.accumulated is not None and p.unsharded.grad is not None:
                p.accumulated += p.unsharded.grad
                p.unsharded.grad = None


def _gradient(p: ShardedParameter) -> torch.Tensor:
    grad = p.unsharded.grad if p.accumulated is None else p.accumulated
    assert grad is not None
    return grad


def _send_buffer(
    ready: list[ShardedParameter], world_size: int, reduce_dtype: torch.dtype
) -> torch.Tensor:
    """The reduce-scatter input: for each rank, every member's padded chunk of its gradient
    back to back (rows from the plan). The unsharded gradients are dropped once copied, before
    the collective allocates its output, as FSDP2 drops them after its copy-in."""
    padded = [p.chunk.padded_numel for p in ready]
    send = _gradient(ready[0]).new_zeros((world_size, sum(padded)), dtype=reduce_dtype)
    for p, pieces in zip(ready, send.split(padded, dim=1), strict=True):
        grad = _gradient(p)
        for held, piece in zip(p.chunks, pieces, strict=True):
            piece[: held.numel].copy_(grad[held.start : held.stop].reshape(-1))
        p.unsharded.grad = p.accumulated = None
    return send


def _reduced(
    ready: list[ShardedParameter], out: torch.Tensor, post: float | None
) -> list[tuple[ShardedParameter, torch.Tensor]]:
    """Each parameter's rows of the reduced ``out`` (divided by ``post``), in its own dtype:
    views of ``out``, or copies under mixed precision (``out`` is then dropped at once)."""
    if post not in (None, 1):
        out.div_(post)
    offset, pieces = 0, []
    for p in ready:
        local = out[offset : offset + p.chunk.numel].view(p.chunk.local_shape)
        pieces.append((p, local.to(p.padded.dtype)))
        offset += p.chunk.padded_numel
    return pieces
