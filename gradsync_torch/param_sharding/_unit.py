"""One unit's parameters: sharded at rest, gathered around use, gradients reduce-scattered.

ZeRO-3, arXiv:1910.02054 §5.3. The hooks (``_hooks.py``) decide *when*; this owns *what*.

The representation is FSDP2's (torch 2.13 ``_fsdp_param.py``), so torch's tools work on it:
each parameter is an ``nn.Parameter`` holding a ``DTensor`` with ``Shard(0)`` whose local
tensor is the *unpadded* view of a zero-padded chunk (the plan's ``ParamChunk``); gathered, it
is a plain ``nn.Parameter`` viewing a buffer whose storage is freed (resized to 0) when
resharded, so autograd's saved tensors see the next gather's data without a copy.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DeviceMesh, DTensor, Placement, Shard

from gradsync_core import ParamChunk
from gradsync_torch._collectives import all_gather_single, reduce_scatter_single
from gradsync_torch.param_sharding._agreement import Wire
from gradsync_torch.param_sharding._divide import gradient_divide
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy
from gradsync_torch.param_sharding._stall import naming_stalls

ROWS = "_gradsync_rows"  # the attribute a sharded parameter carries: its Rows


class Rows(NamedTuple):
    """What a parameter ``fully_shard`` cut into rows says about itself (``ROWS``): who cut
    it and over how many ranks. Read by the checks that must tell gradsync's row shards apart
    from other tensors: an optimizer that reads whole tensors, a call on a parent first."""

    owner: str  # "fully_shard(Sequential)"
    shard_size: int


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
    owner: str = "fully_shard",
) -> ShardedParameter:
    """Replace the parameter at ``places`` by this rank's rows (``chunks[shard_rank]``) as a
    ``DTensor`` on ``mesh`` with ``placements`` (``(Replicate(), Shard(0))`` under HSDP, as
    FSDP2's); a tied parameter is held at several places and swapped at all of them. The new
    parameter carries ``Rows(owner, len(chunks))`` as ``ROWS``."""
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
    setattr(sharded, ROWS, Rows(owner, len(chunks)))
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
        # The shards' version counters when the unit was gathered: a gathered unit whose
        # shards changed since (an optimizer step while it stayed gathered) gathers again.
        self._versions: tuple[tuple[int, int], ...] = ()
        self._gathering: tuple | None = None  # an all-gather in flight (a prefetch)
        self._pending: tuple | None = None  # a reduce-scatter in flight
        self._all_reducing: tuple | None = None  # HSDP: its all-reduce over the replicas
        # FSDPModule's reduction settings (docs/torch-zero3.md, "FSDP2's FSDPModule"):
        self.divide_factor: float | None = None  # set_gradient_divide_factor
        self.force_sum = False  # set_force_sum_reduction_for_comms
        self.all_reduce_grads = True  # set_requires_all_reduce (HSDP)
        # HSDP without the all-reduce: the reduce-scattered sum waiting for the next one,
        # with the members it holds (FSDP2's partial_reduce_output).
        self._partial: tuple[torch.Tensor, tuple[int, ...]] | None = None
        # Reduced gradients waiting for the end-of-backward agreement check before they are
        # stored (store_gradients): a step the ranks ran differently changes no gradient.
        self._reduced: list[tuple[ShardedParameter, torch.Tensor]] = []
        # Called with (collective, member names) before each collective: the hooks' runtime
        # agreement (_agreement.py), so ranks that diverge get a sentence, not a hang.
        self.check: Callable[..., str] | None = None

    def start_gather(self) -> None:
        """Start all-gathering every member (frozen ones too) in one collective, in the
        background (a prefetch: ``gather`` finishes it when the unit is needed)."""
        if self.is_gathered or self._gathering is not None or not self.params:
            return
        dtype = self.params[0].gathered.dtype
        numel = sum(p.chunk.padded_numel for p in self.params)
        wire = Wire("all-gather", self.group, numel, dtype, self.params[0].padded.device)
        label = self._check("all-gather", [p.name for p in self.params], wire=wire)
        send = torch.cat([p.padded.to(dtype) for p in self.params])
        recv = send.new_empty(self.world_size * send.numel())
        work = all_gather_single(recv, send, group=self.group, async_op=True)
        self._gathering = (work, recv, send, label, self._shard_versions())

    def _check(self, op: str, names: list[str], **kwargs: Any) -> str:
        """Agree on collective ``op`` (``self.check``); its label for a stalled-wait error."""
        if self.check is None:
            return f"{op} of {len(names)} parameters"
        return self.check(op, names, **kwargs)

    def _wait(self, work: Any, label: str, group: Any) -> None:
        with naming_stalls(label, group):
            work.wait()

    def _shard_versions(self) -> tuple[tuple[int, int], ...]:
        # An optimizer's in-place step bumps the DTensor's counter (it runs below autograd on
        # the local tensor, whose counter stays); a checkpoint load writes the padded storage.
        return tuple((p.sharded._version, p.padded._version) for p in self.params)

    def gather(self) -> None:
        """Gather the unit (or finish the gather ``start_gather`` began) and swap it in. A
        unit still gathered, or a prefetch still in flight, whose shards changed since (an
        optimizer step after ``set_reshard_after_backward(False)``, ``unshard()`` or a
        prefetch) is gathered again: its copy is stale."""
        if self.is_gathered:
            if not self.params or self._versions == self._shard_versions():
                return
            self.free()
        if not self.params:
            self.is_gathered = True
            return
        self.start_gather()
        assert self._gathering is not None
        work, recv, send, label, versions = self._gathering
        self._gathering = None
        self._wait(work, label, self.group)
        if versions != self._shard_versions():  # a prefetch from before the shards changed
            _release(recv, send)
            self.gather()
            return
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
        self._versions = versions
        self.is_gathered = True

    @property
    def is_gathering(self) -> bool:
        """Whether a prefetch's all-gather is in flight."""
        return self._gathering is not None

    def free(self) -> None:
        """Point the modules back at the shards and release the gathered storage."""
        if self._gathering is not None:  # a prefetch nobody used: complete it, then drop it
            work, recv, send, label, _ = self._gathering
            self._gathering = None
            self._wait(work, label, self.group)
            _release(recv, send)
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
        divide = gradient_divide(
            reduce_dtype,
            self.world_size * self.replicate_size,
            dp_shard=self.world_size,
            factor=self.divide_factor,
            force_sum=self.force_sum,
        )
        if divide.pre not in (None, 1):
            send.div_(divide.pre)
        op = divide.op
        if divide.scale is not None and not _has_premul_sum(self.group):
            # gloo has no PREMUL_SUM (FSDP2 raises there): scale each rank's input, then sum,
            # which is the operation's definition (on NCCL FSDP2's own op runs).
            send.mul_(divide.scale)
            op = dist.ReduceOp.SUM
        work = None
        wire = Wire("reduce-scatter", self.group, send.numel(), reduce_dtype, send.device, op)
        label = self._check("reduce-scatter", [p.name for p in ready], wire=wire)
        if self.world_size > 1:
            # FSDP2's own collective and op (AVG for float32/bfloat16), not the executor's
            # SUM-only reduce_scatter_into: bitwise parity with FSDP2 needs the same reduction.
            work = reduce_scatter_single(out, send.view(-1), op=op, group=self.group, async_op=True)
        elif self.divide_factor is not None and divide.post is None:
            # FSDP2's one-rank path divides by the factor here. (FSDP2 also does when ``post``
            # divides by it again, with force-sum or a float16 reduction: twice. gradsync
            # divides once.)
            out.copy_(send.view(-1) / self.divide_factor)
        else:
            out.copy_(send.view(-1))
        self._pending = (work, send, out, ready, divide, label)

    def finish_reduce(self) -> None:
        """Wait for the reduce-scatter ``reduce_gradients`` started; store the gradients, or
        under HSDP start their all-reduce over the replicas (``finish_all_reduce`` ends it)."""
        if self._pending is None:
            return
        work, send, out, ready, divide, label = self._pending
        self._pending = None
        if work is not None:
            self._wait(work, label, self.group)
        _release(send)  # before the gradients' views are made: the peak is one unit's, not two
        if self.replicate_size > 1:
            members = tuple(id(p) for p in ready)
            if not self.all_reduce_grads:  # FSDP2's partial_reduce_output: sum, reduce later
                if self._partial is None:
                    self._partial = (out, members)
                else:
                    self._add_partial(out, members)
                return
            if self._partial is not None:
                out = self._add_partial(out, members)
                self._partial = None
            label = self._check("all-reduce", [p.name for p in ready], group=self.replicate_group)
            work = dist.all_reduce(
                out, op=divide.all_reduce_op, group=self.replicate_group, async_op=True
            )
            self._all_reducing = (work, out, ready, divide.post, label)
            return
        self._reduced += _reduced(ready, out, divide.post)

    def _add_partial(self, out: torch.Tensor, members: tuple[int, ...]) -> torch.Tensor:
        """``out`` added into the partial sum (the same members, so the same layout)."""
        assert self._partial is not None
        partial, held = self._partial
        if held != members:
            raise ValueError(
                "fully_shard: under set_requires_all_reduce(False) a unit's reduce-scatters "
                "are summed before one all-reduce, but this backward gave gradients to other "
                f"parameters of the unit ({len(members)} vs {len(held)}); use the same "
                "parameters in every micro-step"
            )
        return partial.add_(out)

    def finish_all_reduce(self) -> None:
        """Wait for the HSDP all-reduce ``finish_reduce`` started; store the gradients."""
        if self._all_reducing is None:
            return
        work, out, ready, post, label = self._all_reducing
        self._all_reducing = None
        self._wait(work, label, self.replicate_group)
        self._reduced += _reduced(ready, out, post)

    def store_gradients(self) -> None:
        """Hand the reduced gradients to the sharded ``.grad``s (added to any already there,
        as FSDP2 accumulates across steps); called once the step's collectives agreed."""
        reduced, self._reduced = self._reduced, []
        for p, local in reduced:
            sharded = cast(DTensor, p.sharded)
            grad = sharded.grad
            if grad is not None:
                cast(DTensor, grad)._local_tensor += local
            else:
                p.sharded.grad = DTensor.from_local(
                    local,
                    sharded.device_mesh,
                    sharded.placements,
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


def _has_premul_sum(group: dist.ProcessGroup) -> bool:
    # c10d implements ReduceOp.PREMUL_SUM on NCCL only.
    return "nccl" in str(dist.get_backend(group))


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
