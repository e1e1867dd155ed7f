"""The options of a ZeRO-3 step as one record, ``Zero3Options`` (docs/jax-zero3.md).

``zero3_step`` takes them as keywords or as this record (``gradsync_core.options``), and
``Zero3Step`` is built from the record: one spelling of each option.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gradsync_jax._axes import AxisName
from gradsync_jax.param_sharding.policy import MixedPrecisionPolicy


@dataclass(frozen=True, kw_only=True)
class Zero3Options:
    """How ``zero3_step`` runs a ZeRO-3 step; each field as ``zero3_step``'s keyword of the
    same name explains it.

    Attributes:
        axis_name: the data-parallel mesh axis (or tuple of axes) the parameters are cut over.
        reshard_after_forward: drop each gathered parameter after its use and gather it again
            for the backward (FSDP2's default), or keep it from its first use to the backward.
        batch_spec: the batch's in-spec; ``None``: split on the leading dimension over the
            replicate and shard axes.
        donate: donate the parameters' and optimizer state's buffers to the step.
        accumulate_steps: micro-batches per step, each reduce-scattering its gradients.
        mp_policy: mixed precision (FSDP2's ``MixedPrecisionPolicy``); the default casts
            nothing.
        replicate_axis_name: hybrid sharding's replicate mesh axis; ``None``: none, or the
            one a hybrid-sharding topology's mesh implies.
        compiler_options: XLA options for compiling the step (``jax.jit``'s).

    Raises:
        ValueError: ``accumulate_steps`` not a positive int.

    Example:
        >>> Zero3Options(accumulate_steps=4).reshard_after_forward
        True
    """

    axis_name: AxisName = "dp"
    reshard_after_forward: bool = True
    batch_spec: Any = None
    donate: bool = False
    accumulate_steps: int = 1
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    replicate_axis_name: AxisName | None = None
    compiler_options: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        steps = self.accumulate_steps
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"accumulate_steps must be a positive int, got {steps!r}")
        if not isinstance(self.mp_policy, MixedPrecisionPolicy):
            raise TypeError(
                "mp_policy must be a gradsync_jax.MixedPrecisionPolicy(param_dtype=, "
                f"reduce_dtype=), got {type(self.mp_policy).__name__}"
            )
