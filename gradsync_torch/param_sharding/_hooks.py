"""When a unit gathers, frees and reduces: forward and backward hooks, as FSDP2 places them.

- forward pre-hook: gather the unit (or wait for its prefetch) and start gathering the unit
  that ran next in the previous step's forward; wrap the inputs that need gradients in
  ``_PostBackward``, whose backward runs once autograd is done with this call of the unit;
- forward hook: free the unit if ``reshard_after_forward`` (never the root, which backward
  needs first); hook the outputs so the unit is gathered again before its backward starts;
- pre-backward (the first gradient at a call's outputs): gather, and prefetch the unit whose
  backward comes next (this step's post-forward order reversed, FSDP2's implicit prefetch);
- post-backward: once no call of the unit is still in its backward, reduce-scatter its
  gradients at once (unless gradient sync is off, in which case autograd keeps accumulating
  into the gathered parameters' ``.grad``) and free it; a module called twice per step is
  gathered again for its earlier call and reduce-scatters again, as in FSDP2;
- a callback queued on autograd's engine at the first pre-backward finishes every unit whose
  post-backward did not fire (the root, whose inputs are token ids; a unit without a gradient
  path) when the whole backward is done, and waits for every collective.

The ranks agree on every collective (``_agreement.py``: each one in the first step, then once
per phase, at the backward's start and end), so ranks that run the model differently get one
sentence instead of a hang.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from gradsync_torch.param_sharding._agreement import StepAgreement
from gradsync_torch.param_sharding._policy import MixedPrecisionPolicy, cast_floats
from gradsync_torch.param_sharding._unit import UnitParameters

IDLE, FORWARD, PRE_BACKWARD, POST_BACKWARD = "idle", "forward", "pre_backward", "post_backward"


class Step:
    """What the units of one sharded model share in a step: who they are, the order they ran
    in (for prefetching), the runtime agreement, and whether the end-of-backward callback is
    queued. Created by the outermost ``fully_shard`` call."""

    def __init__(self, units: list[ShardUnit]) -> None:
        self.units = units
        self.callback_queued = False
        self.in_flight: ShardUnit | None = None
        self.agreement = StepAgreement()
        # Forward prefetch follows the previous step's forward order (FSDP2 needs it spelled
        # out with set_modules_to_forward_prefetch); backward prefetch this step's reversed
        # post-forward order, as FSDP2's implicit backward prefetch.
        self.forward_order: list[ShardUnit] = []
        self.last_forward_order: list[ShardUnit] = []
        self.post_forward_order: list[ShardUnit] = []

    def can_schedule(self) -> bool:
        """Whether the runtime agreement may check once per phase (``_agreement.py``): one
        shard group of 2+ ranks for every unit, and no HSDP all-reduce."""
        group = self.units[0].params.group
        return group.size() > 1 and all(
            u.params.group is group and u.params.replicate_group is None for u in self.units
        )

    def queue_callback(self) -> None:
        """The backward starts: agree on the forward (and on which units reduce-scatter),
        then queue ``finish_backward`` at the end of autograd's backward."""
        if not self.callback_queued:
            flags = tuple(u.requires_gradient_sync for u in self.units)
            self.agreement.end_phase(("backward", flags), self.units[0].params.group)
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)

    def finish_backward(self) -> None:
        for unit in self.units:
            if unit.state in (FORWARD, PRE_BACKWARD):
                unit.post_backward(None)
        for unit in self.units:  # the optimizer comes next: every gradient must be in place
            unit.params.finish_reduce()
        for unit in self.units:
            unit.params.finish_all_reduce()
        self.agreement.end_phase("forward", self.units[0].params.group)
        for unit in self.units:  # the ranks agreed on the step: store its gradients
            unit.params.store_gradients()
            unit.params.free()
            unit.state = IDLE
            unit.open_calls.clear()
            unit.seen_calls.clear()
        self.callback_queued = False
        self.in_flight = None
        if self.forward_order:
            self.last_forward_order = self.forward_order
        self.forward_order, self.post_forward_order = [], []

    def start_reduce(self, unit: ShardUnit) -> None:
        """Finish the reduce-scatter in flight, start ``unit``'s: at most one unit's send
        buffer waits at a time, as in FSDP2, while its collective overlaps the backward."""
        if self.in_flight is not None:
            self.in_flight.params.finish_reduce()
        unit.params.reduce_gradients()
        self.in_flight = unit

    def prefetch_after(self, unit: ShardUnit, order: list[ShardUnit], state: str) -> None:
        """Start gathering the unit after ``unit`` in ``order`` if it is in ``state`` and not
        gathered yet: its all-gather then runs while ``unit`` computes."""
        index = next((i for i, u in enumerate(order) if u is unit), None)
        if index is None or index + 1 == len(order):
            return
        nxt = order[index + 1]
        if nxt.state == state and not nxt.params.is_gathered:
            nxt.params.start_gather()


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
        self.calls = 0  # grad-enabled forwards so far: each call's backward is told apart
        self.seen_calls: set[int] = set()  # calls whose backward has started
        self.open_calls: set[int] = set()  # calls whose backward has started, not ended
        self.step = Step([self])
        self.params.check = self.check
        self.handles = [
            module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True),
            module.register_forward_hook(self.post_forward, with_kwargs=True),
        ]

    def check(self, op: str, names: list[str], *, group: Any = None, wire: Any = None) -> None:
        """Agree with the peers before collective ``op`` over ``names`` (``_agreement.py``);
        ``group``: the replicate group of an HSDP all-reduce, else the shard group;
        ``wire``: the collective's shape, what a rank leaving the schedule issues instead."""
        group = self.params.group if group is None else group
        self.step.agreement.check(op, self.prefix, names, group, wire)

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        grad = torch.is_grad_enabled()
        self.params.gather()
        if grad:  # a forward under no_grad (evaluation) leaves the step's state alone
            if self not in self.step.forward_order:
                self.step.forward_order.append(self)
            self.step.prefetch_after(self, self.step.last_forward_order, IDLE)
            self.state = FORWARD
            self.calls += 1
        leaves, spec = tree_flatten((args, kwargs))
        if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
            leaves = [cast_floats(x, self.policy.param_dtype) for x in leaves]
        if not grad:
            return tree_unflatten(leaves, spec)
        needs = [i for i, x in enumerate(leaves) if torch.is_tensor(x) and x.requires_grad]
        if needs:
            wrapped = _PostBackward.apply(self, self.calls, *(leaves[i] for i in needs))
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
            if self not in self.step.post_forward_order:
                self.step.post_forward_order.append(self)
            hook = functools.partial(self.pre_backward, self.calls)
            leaves, _ = tree_flatten(output)
            for tensor in leaves:
                if torch.is_tensor(tensor) and tensor.requires_grad:
                    tensor.register_hook(hook)
        if self.policy.output_dtype is None:
            return output
        leaves, spec = tree_flatten(output)
        return tree_unflatten([cast_floats(x, self.policy.output_dtype) for x in leaves], spec)

    def pre_backward(self, call: int, grad: torch.Tensor) -> torch.Tensor:
        """The first gradient reaching forward call ``call``'s outputs: gather the unit (a
        module called twice per step is gathered again for its earlier call's backward) and
        prefetch the unit whose backward comes next."""
        if call in self.seen_calls:  # the first of the call's outputs' hooks does the work
            return grad
        self.seen_calls.add(call)
        self.open_calls.add(call)
        self.step.queue_callback()
        self.params.gather()
        self.state = PRE_BACKWARD
        self.step.prefetch_after(self, self.step.post_forward_order[::-1], FORWARD)
        return grad

    def post_backward(self, call: int | None) -> None:
        """Autograd finished forward call ``call`` of this unit (``None``: the backward ended):
        once no call is still in its backward, reduce-scatter the gradients and free."""
        self.open_calls.discard(call)
        if self.state == POST_BACKWARD or (call is not None and self.open_calls):
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
    def forward(
        ctx: Any, unit: ShardUnit, call: int, *inputs: torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        ctx.unit, ctx.call = unit, call
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.unit.post_backward(ctx.call)
        return (None, None, *grads)
