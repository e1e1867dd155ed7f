"""The model profile of a torch module: each block's forward and backward time, measured by hooks.

A short run of the user's own step on one rank: a forward pre-hook on every block marks where
its forward starts (a block's forward lasts until the next block starts, so the glue between
blocks and the loss count too and the blocks add up to the measured forward), and
``register_post_accumulate_grad_hook`` on every parameter marks when its gradient is ready:
the moment a data-parallel bucket or a ZeRO-3 unit can be reduced, which is what the cost
model's timeline needs. A block's backward lasts from the previous block's last gradient to
its own. ``saved_tensors_hooks`` count what each block's forward saves for the backward
(activations, parameters left out), and a forward hook the size of its output.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves

from gradsync_core.plan import BlockTime, ModelProfile, median_profile, profile_blocks
from gradsync_torch._specs import named_parameters, param_specs


def _nbytes(value: Any) -> int:
    return sum(t.nbytes for t in tree_leaves(value) if isinstance(t, torch.Tensor))


class _Recorder:
    """The hooks of one profiling run and what they saw in the current step."""

    def __init__(self, model: nn.Module, prefixes: Sequence[str]) -> None:
        self.prefixes = list(prefixes)
        self.handles: list[Any] = []
        self.param_ptrs = {p.data_ptr() for p in model.parameters()}
        self.block_of_param: dict[int, int] = {}
        probe = ModelProfile(
            blocks=tuple(BlockTime(prefix=p, forward_s=0, backward_s=0) for p in self.prefixes),
            samples=1,
            source="measured",
        )
        for name, param in named_parameters(model):
            if param.requires_grad:
                self.block_of_param[id(param)] = probe.block_of(name)
                self.handles.append(param.register_post_accumulate_grad_hook(self._ready))
        for index, prefix in enumerate(self.prefixes):
            if prefix:
                module = model.get_submodule(prefix)
                self.handles.append(module.register_forward_pre_hook(self._pre(index)))
                self.handles.append(module.register_forward_hook(self._post(index)))
        self.reset()

    def reset(self) -> None:
        self.started: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.saved = [0] * len(self.prefixes)
        self.outputs = [0] * len(self.prefixes)
        self.current = 0
        self.seen: set[int] = set()

    def _pre(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            self.started.setdefault(index, time.perf_counter())
            self.current = index

        return hook

    def _post(self, index: int) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self.outputs[index] = _nbytes(output)

        return hook

    def _ready(self, param: torch.Tensor) -> None:
        self.done[self.block_of_param[id(param)]] = time.perf_counter()

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        ptr = tensor.untyped_storage().data_ptr()
        if ptr not in self.param_ptrs and ptr not in self.seen:
            self.seen.add(ptr)
            self.saved[self.current] += tensor.untyped_storage().nbytes()
        return tensor

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def profile_model(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    *,
    samples: int,
    blocks: Sequence[str] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    steps: int = 5,
    warmup: int = 2,
    scratch: bool = True,
) -> ModelProfile:
    """Time ``model``'s blocks over a few steps of ``loss_fn`` on this rank.

    Each step gives one profile; ``median_profile`` merges them (the median forward and
    backward, split over the blocks by their medians), so a preemption on a loaded machine
    moves the totals no more than it moves a real step.

    Args:
        model: the plain module (not wrapped: the profile is of the compute alone).
        loss_fn: runs the forward on one microbatch and returns the loss, e.g.
            ``lambda: F.mse_loss(model(x), y)``.
        samples: the samples in that microbatch.
        blocks: module paths to time (default ``profile_blocks(param_specs(model))``: the
            numbered blocks and the modules outside them).
        optimizer: if given, its ``step()`` is timed too (the profile's ``optimizer_s``),
            and the scratch it allocates is measured once (``optimizer_bytes``, torch's
            profiler).
        steps: timed steps.
        warmup: untimed steps first.
        scratch: measure the optimizer's scratch (one more step, under torch's profiler).

    Returns:
        The ``"measured"`` profile: blocks in the order their forwards ran.

    Raises:
        ValueError: ``steps < 1``, or a block the forward never ran.

    Example:
        >>> net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
        >>> x = torch.randn(4, 8)
        >>> profile = profile_model(net, lambda: net(x).square().mean(), samples=4, steps=2)
        >>> [b.prefix for b in profile.blocks]
        ['0', '2']
    """
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps must be a positive int, got {steps!r}")
    prefixes = list(blocks) if blocks is not None else profile_blocks(param_specs(model))
    recorder = _Recorder(model, prefixes)
    runs = []
    try:
        for step in range(warmup + steps):
            run = _step(model, loss_fn, recorder, prefixes, samples, optimizer)
            if step >= warmup:
                runs.append(run)
    finally:
        recorder.remove()
    measured = optimizer is not None and scratch
    merged = median_profile(runs)
    return replace(
        merged,
        optimizer_bytes=_optimizer_scratch(model, loss_fn, optimizer)
        if measured and optimizer is not None
        else None,
        note=f"gradsync_torch.profile_model: torch {torch.__version__}, "
        f"{torch.get_num_threads()} thread(s), {steps} steps",
    )


def _step(
    model: nn.Module,
    loss_fn: Callable[[], torch.Tensor],
    recorder: _Recorder,
    prefixes: Sequence[str],
    samples: int,
    optimizer: torch.optim.Optimizer | None,
) -> ModelProfile:
    """One step, as a profile of its own."""
    model.zero_grad(set_to_none=True)
    recorder.reset()
    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(recorder.pack, lambda t: t):
        loss = loss_fn()
    forward_end = time.perf_counter()
    loss.backward()
    backward_end = time.perf_counter()
    optimizer_s = 0.0
    if optimizer is not None:
        optimizer.step()
        optimizer_s = time.perf_counter() - backward_end
    order = _order(recorder, prefixes)
    forward = _forward_times(recorder, order, start, forward_end)
    backward = _backward_times(recorder, order, forward_end, backward_end)
    return ModelProfile(
        blocks=tuple(
            BlockTime(
                prefix=prefixes[i],
                forward_s=forward[i],
                backward_s=backward[i],
                activation_bytes=recorder.saved[i],
                output_bytes=recorder.outputs[i],
            )
            for i in order
        ),
        samples=samples,
        source="measured",
        optimizer_s=optimizer_s,
    )


def _optimizer_scratch(
    model: nn.Module, loss_fn: Callable[[], torch.Tensor], optimizer: torch.optim.Optimizer
) -> int:
    """The most bytes ``optimizer.step()`` allocates beyond what exists before it (its
    state already there, after the first step)."""
    model.zero_grad(set_to_none=True)
    loss_fn().backward()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        optimizer.step()
    live = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for event in sorted(events, key=lambda e: e.start_ns()):
        if event.device_type() == torch.autograd.DeviceType.CPU:
            live += event.nbytes()
            peak = max(peak, live)
    model.zero_grad(set_to_none=True)
    return peak


def _order(recorder: _Recorder, prefixes: Sequence[str]) -> list[int]:
    """The blocks in the order their forwards started; a block without a module of its own
    (the root ``""``) first."""
    missing = [
        prefixes[i] for i in range(len(prefixes)) if prefixes[i] and i not in recorder.started
    ]
    if missing:
        raise ValueError(
            f"the forward never ran block {missing[0]!r}; list the modules the forward calls "
            "(blocks=) or leave blocks to profile_blocks"
        )
    rootless = [i for i in range(len(prefixes)) if not prefixes[i]]
    return rootless + sorted(recorder.started, key=recorder.started.__getitem__)


def _forward_times(
    recorder: _Recorder, order: Sequence[int], start: float, end: float
) -> dict[int, float]:
    """Each block's forward: from its start to the next one's (the last to the loss), the
    time before the first block counted in the first."""
    marks = [recorder.started.get(i, start) for i in order] + [end]
    marks[0] = start
    return {i: marks[k + 1] - marks[k] for k, i in enumerate(order)}


def _backward_times(
    recorder: _Recorder, order: Sequence[int], start: float, end: float
) -> dict[int, float]:
    """Each block's backward: from the previous block's last gradient (in backward order) to
    its own; a block whose gradients came earlier than that, or without any, gets 0 and its
    time goes to the next; the first block takes the rest of the backward."""
    out: dict[int, float] = {}
    previous = start
    for i in reversed(order):
        done = max(recorder.done.get(i, previous), previous)
        out[i] = done - previous
        previous = done
    out[order[0]] += end - previous
    return out
