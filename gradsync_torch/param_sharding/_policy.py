"""Mixed precision for parameter sharding, spelled as FSDP2's ``MixedPrecisionPolicy``."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtypes the gathered parameters and the gradient reduction use.

    The sharded parameters (what the optimizer sees) keep their own dtype; ``param_dtype``
    casts them on the way into the all-gather, so forward and backward run in it, and
    ``reduce_dtype`` is the dtype of the reduce-scatter (default: the gradients' dtype). The
    reduced gradient is cast back to the sharded parameter's dtype. ``None`` keeps the dtype.

    Example:
        >>> MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is not None and not (
                isinstance(value, torch.dtype) and value.is_floating_point
            ):
                raise ValueError(
                    f"{key} must be a floating torch.dtype such as torch.bfloat16 or None, "
                    f"got {value!r}"
                )
