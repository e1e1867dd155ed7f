"""Mixed precision for parameter sharding, spelled as FSDP2's ``MixedPrecisionPolicy``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtypes the gathered parameters and the gradient reduction use (FSDP2's fields).

    The sharded parameters (what the optimizer sees) keep their own dtype; ``param_dtype``
    casts them on the way into the all-gather, so forward and backward run in it, and
    ``reduce_dtype`` is the dtype of the reduce-scatter (default: the gradients' dtype) and of
    gradients accumulated without sync. The reduced gradient is cast back to the sharded
    parameter's dtype. ``output_dtype`` casts a unit's floating outputs;
    ``cast_forward_inputs`` casts its floating inputs to ``param_dtype``. ``None`` keeps a dtype.

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, \
output_dtype=None, cast_forward_inputs=True)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, key)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"{key} must be a floating torch.dtype such as torch.bfloat16 or None, "
                    f"got {value!r}"
                )


def cast_floats(value: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``value`` in ``dtype`` if it is a floating tensor of another dtype (FSDP2's
    ``_cast_fp_tensor``); anything else unchanged."""
    if dtype is None or not torch.is_tensor(value) or not value.is_floating_point():
        return value
    return value if value.dtype == dtype else value.to(dtype)
