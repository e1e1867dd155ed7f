"""When a unit gathers, frees and reduces: forward and backward hooks, as FSDP2 places them.

- forward pre-hook: gather the unit; wrap the inputs that need gradients in ``_PostBackward``,
  whose backward runs once autograd is done with the unit (its inputs' gradients exist);
- forward hook: free the unit if ``reshard_after_forward`` (never the root, which backward
  needs first); hook the outputs so the unit is gathered again before its backward starts;
- post-backward: reduce-scatter the unit's gradients at once (unless gradient sync is off, in
  which case autograd keeps accumulating into the gathered parameters' ``.grad``), free it;
- a callback queued on autograd's engine at the first pre-backward finishes every unit whose
  post-backward did not fire (the root, whose inputs are token ids; a unit without a gradient
  path) when the whole backward is done.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy, cast_floats
from gradsync_torch.param_sharding._unit import UnitParameters

IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = "idle", "forward", "pre_backward", "post_backward"


class Step:
    """What the units of one sharded model share in a step: who they are, and whether the
    end-of-backward callback is queued. Created by the outermost ``fully_shard`` call."""

    def __init__(self, units: list[ShardUnit]) -> None:
        self.units = units
        self.callback_queued = False
        self.in_flight: ShardUnit | None = None

    def queue_callback(self) -> None:
        if not self.callback_queued:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        for unit in self.units:
            if unit.state in (FORWARD, PRE_BACKWARD):
                unit.post_backward()
        for unit in self.units:  # the optimizer comes next: every gradient must be in place
            unit.params.finish_reduce()
            unit.params.free()
            unit.state = IDLE
        self.callback_queued = False
        self.in_flight = None

    def start_reduce(self, unit: ShardUnit) -> None:
        """Finish the reduce-scatter in flight, start ``unit``'s: at most one unit's send
        buffer waits at a time, as in FSDP2, while its collective overlaps the backward."""
        if self.in_flight is not None:
            self.in_flight.params.finish_reduce()
        unit.params.reduce_gradients()
        self.in_flight = unit


class ShardUnit:
    """One ``fully_shard`` call at run time: its module, parameters, options and state."""

    def __init__(
        self,
        module: nn.Module,
        prefix: str,
        params: UnitParameters,
        *,
        reshard_after_forward: bool,
        policy: MixedPrecisionPolicy,
    ) -> None:
        self.module = module
        self.policy = policy
        self.prefix = prefix  # the module path inside the model, "" for the root
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.requires_gradient_sync = True
        self.is_root = True  # until an outer fully_shard claims it
        # id -> weakref of the parameters this call replaced: an outer call refuses a weight
        # tied to one of them (its users would be in two units).
        self.originals: dict[int, Any] = {}
        self.state = IDLE
        self.step = Step([self])
        self.handles = [
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self.post_forward, with_kwargs=True),
        ]

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        self.params.gather()
        self.state = FORWARD
        leaves, spec = tree_flatten((args, kwargs))
        if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
            leaves = [cast_floats(x, self.policy.param_dtype) for x in leaves]
        if not torch.is_grad_enabled():
            return tree_unflatten(leaves, spec)
        needs = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if needs:
            wrapped = _PostBackward.apply(self, *(leaves[i] for i in needs))
            for i, tensor in zip(needs, wrapped, strict=True):
                leaves[i] = tensor
        return tree_unflatten(leaves, spec)

    def post_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any
    ) -> Any:
        grad = torch.is_grad_enabled()
        if not grad or (self.reshard_after_forward and not self.is_root):
            self.params.free()
        if grad:
            leaves, _ = tree_flatten(output)
            for tensor in leaves:
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(self.pre_backward)
        if self.policy.output_dtype is None:
            return output
        leaves, spec = tree_flatten(output)
        return tree_unflatten([cast_floats(x, self.policy.output_dtype) for x in leaves], spec)

    def pre_backward(self, grad: torch.Tensor) -> torch.Tensor:
        if self.state == FORWARD:  # the first of the outputs' hooks does the work
            self.step.queue_callback()
            self.params.gather()
            self.state = PRE_BACKWARD
        return grad

    def post_backward(self) -> None:
        if self.state == POST_BACKWARD:
            return
        self.state = POST_BACKWARD
        if self.requires_gradient_sync:
            self.step.start_reduce(self)
        else:
            self.params.keep_gradients()
        self.params.free()


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs when their gradients exist, which is
    when autograd has finished the unit (FSDP2's ``RegisterPostBackwardFunction``)."""

    @staticmethod
    def forward(ctx: Any, unit: ShardUnit, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.unit = unit
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.unit.post_backward()
        return (None, *grads)
