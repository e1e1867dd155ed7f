"""When a unit gathers, frees and reduces: forward and backward hooks, as FSDP2 places them.

- forward pre-hook: gather the unit (or wait for its prefetch) and start gathering the unit
  that ran next in the previous step's forward (or the units ``set_modules_to_forward_prefetch``
  named); wrap the inputs that need gradients in ``_PostBackward``, whose backward runs once
  autograd is done with this call of the unit;
- forward hook: free the unit if ``reshard_after_forward`` (never the root, which backward
  needs first); hook the outputs so the unit is gathered again before its backward starts.
  A unit of several modules (FSDP2's list form, ``fully_shard([norm, output])``) does this
  once per forward of the root: its pre-hook work when its first module starts, its forward
  hook's when its last one ends (or, for a module the forward skipped, when the root's ends);
- pre-backward (the first gradient at a call's outputs): gather, and prefetch the unit whose
  backward comes next (this step's post-forward order reversed, FSDP2's implicit prefetch);
- post-backward: once no call of the unit is still in its backward, reduce-scatter its
  gradients at once (unless gradient sync is off, in which case autograd keeps accumulating
  into the gathered parameters' ``.grad``) and free it (unless ``reshard_after_backward`` is
  off); a module called twice per step is gathered again for its earlier call and
  reduce-scatters again, as in FSDP2;
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
        self.in_forward = False  # the root's forward is running (a list unit's modules may)
        # FSDPModule.set_is_last_backward: FSDP2 then skips waiting for its reductions at the
        # end of backward; gradsync always waits (every gradient is in place, the same bits).
        self.is_last_backward = True
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
            if unit.reshard_after_backward:
                unit.params.free()
            unit.state = IDLE
            unit.pending.clear()
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

    def complete_forwards(self, output: Any) -> Any:
        """The root's forward ends: a list unit whose forward skipped some of its modules
        finishes its forward now, its backward hooked on the root's ``output`` (FSDP2's
        ``_force_complete_incomplete_states``)."""
        for unit in reversed(self.units):
            if unit.pending:
                unit.pending.clear()
                output = unit.finish_forward(output)
        self.in_forward = False
        return output


class ShardUnit:
    """One ``fully_shard`` call at run time: its module, parameters, options and state."""

    def __init__(
        self,
        modules: tuple[nn.Module, ...],
        prefix: str,
        params: UnitParameters,
        *,
        reshard_after_forward: bool,
        policy: MixedPrecisionPolicy,
    ) -> None:
        self.modules = modules  # one, or several for FSDP2's list form
        # How sentences name the call: fully_shard(Block), fully_shard([LayerNorm, Linear]).
        names = ", ".join(type(m).__name__ for m in modules)
        self.name = f"fully_shard([{names}])" if len(modules) > 1 else f"fully_shard({names})"
        self.policy = policy
        self.prefix = prefix  # the module path inside the model, "" for the root
        self.params = params
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True  # FSDPModule.set_reshard_after_backward
        self.requires_gradient_sync = True
        # FSDPModule.set_modules_to_{forward,backward}_prefetch: the units to start gathering
        # instead of the learnt next one (None: learnt).
        self.forward_prefetch: list[ShardUnit] | None = None
        self.backward_prefetch: list[ShardUnit] | None = None
        self.pending: set[nn.Module] = set()  # a list unit's modules yet to run this forward
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
            handle
            for module in modules
            for handle in (
                module.register_forward_pre_hook(self.pre_forward, prepend=True, with_kwargs=True),
                module.register_forward_hook(self.post_forward, with_kwargs=True),
            )
        ]

    def check(self, op: str, names: list[str], *, group: Any = None, wire: Any = None) -> str:
        """Agree with the peers before collective ``op`` over ``names`` (``_agreement.py``);
        ``group``: the replicate group of an HSDP all-reduce, else the shard group;
        ``wire``: the collective's shape, what a rank leaving the schedule issues instead.
        Returns the collective's label (for a stalled wait's sentence)."""
        group = self.params.group if group is None else group
        return self.step.agreement.check(op, self.prefix, names, group, wire)

    def _grouped(self) -> bool:
        """Whether this call is one of a list unit's modules inside the root's forward."""
        return len(self.modules) > 1 and self.step.in_forward

    def _check_list_call(self) -> None:
        if self.is_root:
            raise ValueError(
                f"{self.name} made a unit of several modules but no fully_shard call on a "
                "module containing them followed, so there is no root to run them in; call "
                "fully_shard on the model last, as FSDP2 requires"
            )
        raise ValueError(
            f"{self.name}: one of its modules ran with gradients outside the model's forward "
            "(a chunked loss calling the head on its own); gradsync runs a unit of several "
            "modules within one forward of the root: call them inside the model's forward, "
            "or shard the head in its own fully_shard call"
        )

    def _prefetch_forward(self) -> None:
        if self.forward_prefetch is None:
            self.step.prefetch_after(self, self.step.last_forward_order, IDLE)
            return
        for unit in self.forward_prefetch:
            if not unit.params.is_gathered:
                unit.params.start_gather()

    def pre_forward(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        grad = torch.is_grad_enabled()
        if self.is_root and len(self.modules) == 1:
            self.step.in_forward = True
            for unit in self.step.units:  # a forward that raised may have left some
                unit.pending.clear()
        if grad and len(self.modules) > 1 and not self.step.in_forward:
            self._check_list_call()
        # A list unit's later modules in the same forward: already gathered and hooked.
        first = not (self._grouped() and self.pending)
        if self._grouped():
            self.pending = self.pending or set(self.modules)
        self.params.gather()
        if grad and first:  # a forward under no_grad (evaluation) leaves the step's state alone
            if self not in self.step.forward_order:
                self.step.forward_order.append(self)
            self._prefetch_forward()
            self.state = FORWARD
            self.calls += 1
        leaves, spec = tree_flatten((args, kwargs))
        if self.policy.cast_forward_inputs and self.policy.param_dtype is not None:
            leaves = [cast_floats(x, self.policy.param_dtype) for x in leaves]
        if not grad or not first:
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
        if self._grouped():
            self.pending.discard(module)
            if self.pending:  # more of the list's modules to run: stay gathered
                return self._cast_output(output)
        output = self.finish_forward(output)
        if self.is_root and len(self.modules) == 1:
            output = self.step.complete_forwards(output)
        return output

    def finish_forward(self, output: Any) -> Any:
        """The unit's forward is done: free it (``reshard_after_forward``, never the root) and
        hook ``output`` so that its backward gathers it again."""
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
        return self._cast_output(output)

    def _cast_output(self, output: Any) -> Any:
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
        if self.backward_prefetch is None:
            self.step.prefetch_after(self, self.step.post_forward_order[::-1], FORWARD)
        else:
            for unit in self.backward_prefetch:
                if not unit.params.is_gathered:
                    unit.params.start_gather()
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
        if self.reshard_after_backward:
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
