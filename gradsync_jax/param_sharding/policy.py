"""Mixed precision for ZeRO-3, spelled as FSDP2's ``MixedPrecisionPolicy``.

Torch's ``gradsync_torch.MixedPrecisionPolicy`` has the same name and fields;
``zero3_step(..., mp_policy=...)`` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True, slots=True)
class MixedPrecisionPolicy:
    """Which dtypes the gathered parameters and the gradient reduction use (FSDP2's fields
    that apply to a JAX step; ``output_dtype`` and ``cast_forward_inputs`` cast a module's
    outputs and inputs, and a ``zero3_step`` loss has no module boundaries).

    The sharded parameters (what the optimizer sees) keep their own dtype: fp32 master
    parameters. ``param_dtype`` casts the chunks before the all-gather, so the model computes
    in it and the gather moves its bytes; ``reduce_dtype`` is the dtype the gradients are
    reduce-scattered in (default ``param_dtype``, as FSDP2's), cast back to the stored dtype
    after. ``None`` keeps a dtype.

    Example:
        >>> MixedPrecisionPolicy(param_dtype=jnp.bfloat16, reduce_dtype=jnp.float32)
        MixedPrecisionPolicy(param_dtype=<class 'jax.numpy.bfloat16'>, \
reduce_dtype=<class 'jax.numpy.float32'>)
    """

    param_dtype: Any = None
    reduce_dtype: Any = None

    def __post_init__(self) -> None:
        for key in ("param_dtype", "reduce_dtype"):
            value = getattr(self, key)
            if value is None:
                continue
            try:
                floating = jnp.issubdtype(np.dtype(value), jnp.floating)
            except TypeError:
                floating = False
            if not floating:
                raise ValueError(
                    f"{key} must be a floating dtype such as jnp.bfloat16 or None, got {value!r}"
                )

    def gathered(self, chunk: Any) -> Any:
        """``chunk`` as the all-gather sends it (``param_dtype``)."""
        return chunk if self.param_dtype is None else chunk.astype(self.param_dtype)

    def reduced(self, grad: Any) -> Any:
        """``grad`` as the reduce-scatter sums it (``reduce_dtype``, else ``param_dtype``)."""
        dtype = self.param_dtype if self.reduce_dtype is None else self.reduce_dtype
        return grad if dtype is None else grad.astype(dtype)
