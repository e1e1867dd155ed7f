"""``FSDPModule``: the class ``fully_shard`` gives a sharded module, answered by gradsync.

See docs/torch-zero3.md, "FSDP2's FSDPModule".

FSDP2 swaps a sharded module's class for ``FSDP<Cls>``, a subclass of ``FSDPModule`` and the
module's own class; torchtitan finds its units with ``isinstance(m, FSDPModule)`` and sets them
up through its methods (``set_gradient_divide_factor(1.0)`` on every unit). gradsync does the
same with ``Sharded<Cls>``, whose ``ShardedModule`` base *is* an ``FSDPModule``, and defines
every attribute ``FSDPModule`` has, so none of FSDP2's methods runs on gradsync's state: the
ones that change results (reduction factors and ops, gradient sync, resharding, prefetching)
do what FSDP2's do, bitwise (tests/torch/test_fully_shard_fsdp2_api.py); the others raise
``NotImplementedError`` with a sentence.
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, NoReturn

from torch.distributed.fsdp import FSDPModule, UnshardHandle

from gradsync_core import ParamShardPlan

if TYPE_CHECKING:
    from gradsync_torch.param_sharding._hooks import ShardUnit

UNIT = "_gradsync_shard_unit"  # the attribute a sharded module keeps its ShardUnit in
PLAN = "_gradsync_shard_plan"  # ... and the plan its fully_shard call cut


def unit_of(module: Any) -> ShardUnit | None:
    """The ``ShardUnit`` of a module ``fully_shard`` sharded, else ``None``."""
    return getattr(module, UNIT, None)


class _Handle(UnshardHandle):
    """``unshard(async_op=True)``'s handle: ``wait()`` finishes the all-gather."""

    def __init__(self, unit: ShardUnit) -> None:
        self._unit: ShardUnit | None = unit

    def wait(self) -> None:
        if self._unit is not None:
            self._unit.params.gather()
            self._unit = None


def _unsupported(name: str, what: str, instead: str) -> NoReturn:
    raise NotImplementedError(
        f"{name} is FSDP2's {what}, which gradsync_torch.fully_shard does not implement; {instead}"
    )


_NO_STREAMS = "gradsync issues its own collectives on the default stream; remove the call"


class ShardedModule(FSDPModule):
    """Mixed into a module's class by ``fully_shard``: FSDP2's ``FSDPModule``, its methods
    acting on gradsync's units.

    Implemented as FSDP2's: ``unshard``, ``reshard``,
    ``set_requires_gradient_sync``, ``set_requires_all_reduce``, ``set_reshard_after_forward``,
    ``set_reshard_after_backward``, ``set_is_last_backward``, ``set_gradient_divide_factor``
    (and its deprecated ``set_reduce_scatter_divide_factor``),
    ``set_force_sum_reduction_for_comms``, ``set_modules_to_forward_prefetch``,
    ``set_modules_to_backward_prefetch``. Every other ``FSDPModule`` method raises
    ``NotImplementedError`` naming itself."""

    # FSDPModule.__new__ reads the original class at this index of the MRO:
    # [Sharded<Cls>, ShardedModule, FSDPModule, Cls, ...].
    _orig_cls_mro_index: int = 3

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        # As FSDP2's: building a module of a sharded module's class (a Sequential's slice
        # builds type(self)(...)) builds the original class, not a sharded one without a unit.
        original = cls.__mro__[cls._orig_cls_mro_index]
        self = original.__new__(original, *args, **kwargs)
        self.__init__(*args, **kwargs)
        return self

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # nn.Module's own (.to(), .float()), not FSDPModule's, which reads FSDP2's state.
        return super(FSDPModule, self)._apply(*args, **kwargs)  # type: ignore[misc]

    def _units(self, recurse: bool) -> list[ShardUnit]:
        """This module's unit and, with ``recurse``, every unit inside it (each once)."""
        modules = self.modules() if recurse else [self]  # type: ignore[attr-defined]
        units: dict[int, ShardUnit] = {}
        for m in modules:
            unit = unit_of(m)
            if unit is not None:
                units.setdefault(id(unit), unit)
        return list(units.values())

    def _unit(self) -> ShardUnit:
        unit = unit_of(self)
        assert unit is not None, "a ShardedModule always has its unit"
        return unit

    @property
    def shard_plan(self) -> ParamShardPlan:
        """The plan this call was cut from (module paths relative to this module; under the
        list form, ``0.``, ``1.``, ... for the list's modules)."""
        return getattr(self, PLAN)

    # What FSDP2's FSDPModule does, on gradsync's units ------------------------------------

    def reshard(self) -> None:
        """Free this module's gathered parameters, back to the shards (not recursive)."""
        self._unit().params.free()

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's unit now (it stays gathered until ``reshard`` or the end of
        the next backward; not recursive). With ``async_op`` the all-gather runs in the
        background and the returned handle's ``wait()`` (or the unit's next forward)
        finishes it."""
        unit = self._unit()
        if not async_op:
            unit.params.gather()
            return None
        unit.params.start_gather()
        return _Handle(unit)

    def set_requires_gradient_sync(
        self, requires_gradient_sync: bool, *, recurse: bool = True
    ) -> None:
        """Turn the reduce-scatter after backward off (micro-steps of gradient accumulation:
        gradients then accumulate unsharded) or back on, for this unit and, with ``recurse``,
        every unit inside it; under HSDP the all-reduce goes with it. FSDP2's method."""
        for unit in self._units(recurse):
            unit.requires_gradient_sync = requires_gradient_sync
            unit.params.all_reduce_grads = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: reduce-scatter but skip the all-reduce over the replicas (off), summing the
        reduce-scattered gradients until a backward with it on all-reduces the sum; no
        effect without replicas. FSDP2's method."""
        for unit in self._units(recurse):
            unit.params.all_reduce_grads = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Free the gathered parameters after forward (``True``) or keep them for the
        backward; the root always keeps them, as under FSDP2's default. FSDP2's method."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(
                f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}"
            )
        for unit in self._units(recurse):
            unit.reshard_after_forward = reshard_after_forward

    def set_reshard_after_backward(
        self, reshard_after_backward: bool, *, recurse: bool = True
    ) -> None:
        """Free the gathered parameters after backward (``True``, the default) or keep them
        for the next forward (micro-steps of accumulation: one all-gather fewer each). A unit
        kept gathered across an optimizer step gathers again before its next use, so it never
        computes with its parameters' old values. FSDP2's method."""
        for unit in self._units(recurse):
            unit.reshard_after_backward = reshard_after_backward

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for FSDP2's recipes; it changes nothing: FSDP2 skips waiting for the
        reductions at the end of a backward that is not the last, gradsync always waits, and
        either way each gradient ends the same."""
        self._unit().step.is_last_backward = is_last_backward

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide the summed gradients by ``factor`` instead of the number of data-parallel
        ranks (torchtitan sets 1.0 and normalizes its loss by the global token count); this
        module's unit only, as FSDP2's. FSDP2's reduce-scatter multiplies each rank's input by
        ``1 / factor`` (``PREMUL_SUM``; on gloo, which lacks it, gradsync multiplies before a
        sum, and FSDP2 raises)."""
        if not isinstance(factor, numbers.Real) or isinstance(factor, bool) or not factor > 0:
            raise ValueError(
                f"the gradient divide factor must be a positive number, got {factor!r}"
            )
        self._unit().params.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated (as in FSDP2): ``set_gradient_divide_factor``."""
        warnings.warn(
            "set_reduce_scatter_divide_factor is deprecated: use set_gradient_divide_factor",
            DeprecationWarning,
            stacklevel=2,
        )
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with sums only, dividing before and after the collectives instead of inside
        them (FSDP2's factors); this module's unit only, as FSDP2's."""
        self._unit().params.force_sum = bool(enable)

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering these sharded modules' units when this one's forward starts,
        instead of the unit that ran next in the previous step. FSDP2's method."""
        self._unit().forward_prefetch = _prefetch_units(modules)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start gathering these sharded modules' units when this one's backward starts,
        instead of the one before it in this step's forward. FSDP2's method."""
        self._unit().backward_prefetch = _prefetch_units(modules)

    # FSDP2's, not gradsync's ------------------------------------------------------------

    def reset_iter_state(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "reset_iter_state",
            "recovery from an exception inside forward or backward",
            "a failed step leaves a gradsync model unusable: rebuild it and load a checkpoint",
        )

    def set_custom_all_gather(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_custom_all_gather", "replacement all-gather", "gradsync gathers with its own"
        )

    def set_custom_reduce_scatter(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_custom_reduce_scatter",
            "replacement reduce-scatter",
            "gradsync reduces with its own (set_gradient_divide_factor and "
            "set_force_sum_reduction_for_comms choose its arithmetic)",
        )

    def set_all_reduce_hook(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_all_reduce_hook",
            "hook on the reduced gradients",
            "reduce the sharded .grad DTensors after backward instead",
        )

    def set_post_optim_event(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("set_post_optim_event", "stream event", _NO_STREAMS)

    def set_reduce_scatter_unused_params(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_reduce_scatter_unused_params",
            "zero gradients for unused parameters",
            "use every parameter of a unit in every step on every rank (or freeze it)",
        )

    def set_reduce_scatter_max_input_buffers(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_reduce_scatter_max_input_buffers",
            "reduce-scatter buffer cap",
            "gradsync keeps one reduce-scatter in flight, FSDP2's default",
        )

    def set_separate_reduce_scatter_group(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_separate_reduce_scatter_group",
            "second process group",
            "gradsync runs its collectives on the mesh's group",
        )

    def set_unshard_in_backward(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "set_unshard_in_backward",
            "backward without the gathered parameters",
            "gradsync gathers every unit for its backward",
        )

    def set_allocate_memory_from_process_group_for_comm(
        self, *args: Any, **kwargs: Any
    ) -> NoReturn:
        _unsupported(
            "set_allocate_memory_from_process_group_for_comm", "buffer allocator", _NO_STREAMS
        )

    def set_symm_mem_for_comm(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("set_symm_mem_for_comm", "symmetric-memory buffers", _NO_STREAMS)

    def _set_unshard_async_op(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported("_set_unshard_async_op", "unshard stream option", _NO_STREAMS)

    def _get_fsdp_state(self, *args: Any, **kwargs: Any) -> NoReturn:
        _unsupported(
            "_get_fsdp_state",
            "internal state",
            "this module was sharded by gradsync_torch.fully_shard, which keeps no FSDP2 "
            "state: torch code that reads it (pipelining schedules, FSDP2's memory tracker, "
            "register_fsdp_forward_method) works with torch's fully_shard only",
        )


def _prefetch_units(modules: Iterable[Any]) -> list[ShardUnit]:
    units: dict[int, ShardUnit] = {}
    for module in modules:
        unit = unit_of(module)
        if unit is None:
            raise ValueError(
                f"prefetching takes modules sharded by gradsync_torch.fully_shard, got a "
                f"{type(module).__name__} it did not shard; pass the sharded blocks"
            )
        units.setdefault(id(unit), unit)  # a list unit's modules are one unit
    return list(units.values())


def sharded_class(cls: type) -> type:
    """``Sharded<Cls>``: ``cls`` with ``ShardedModule`` first in its MRO (cached)."""
    if issubclass(cls, ShardedModule):
        return cls
    cached = _CLASSES.get(cls)
    if cached is None:
        cached = _CLASSES[cls] = type(f"Sharded{cls.__name__}", (ShardedModule, cls), {})
    return cached


_CLASSES: dict[type, type] = {}
