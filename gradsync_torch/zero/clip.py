"""Clipping by the global gradient norm when each rank holds pieces of the gradients (ZeRO-2).

torch's ``clip_grad_norm_`` takes the norm of the per-tensor norms, which for a finite ``p``
is ``(sum of |g|**p over every element) ** (1/p)`` and for ``inf`` the largest ``|g|``: both
are sums (or maxima) over elements, so they split over any partition of the elements. Each rank
sums ``norm(piece) ** p`` over its pieces (maxima for ``inf``), one all-reduce combines the
ranks, and the clip coefficient is torch's: ``min(max_norm / (total + 1e-6), 1)``, multiplied
into every piece with ``torch._foreach_mul_``. FSDP1's ``clip_grad_norm_`` does the same over
its flat shards.

The maximum is exact, so the ``inf`` norm equals DDP's bit for bit. A finite ``p`` adds the
pieces' powers where torch adds whole tensors', so the last bits differ; the sum runs in
float64 so that only the pieces' own float32 norms round (torch's float32 norm of one whole
tensor is itself 1e-7 to 1e-5 off the exact value, by size).
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist


def check_norm_type(norm_type: float) -> float:
    """``norm_type`` as a float.

    Raises:
        ValueError: unless it is a positive number or ``inf``.
    """
    p = float(norm_type)
    if not p > 0:  # NaN too
        raise ValueError(
            f"norm_type must be a positive number or inf (2.0: the Euclidean norm), got "
            f"{norm_type!r}"
        )
    return p


def clip_sharded_(
    grads: list[torch.Tensor],
    max_norm: float,
    norm_type: float,
    *,
    dtype: torch.dtype,
    device: torch.device,
    group: dist.ProcessGroup | None,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """Clip ``grads`` (this rank's pieces) by the norm of every rank's pieces together.

    A collective: every rank of ``group`` calls it, each with its own pieces (maybe none).

    Args:
        grads: this rank's gradient pieces, scaled in place.
        max_norm: the largest norm left unscaled.
        norm_type: ``p`` of the p-norm, positive, or ``inf``.
        dtype: the norm's dtype (torch's: the gradients' common dtype), the same on every rank.
        device: where the norm lives (the parameters' device).
        group: the ranks holding the other pieces.
        error_if_nonfinite: raise instead of scaling by a NaN or infinite norm.

    Returns:
        The total norm, a 0-d tensor of ``dtype``, equal on every rank.

    Raises:
        RuntimeError: with ``error_if_nonfinite``, on every rank, if the norm is not finite.
    """
    p = check_norm_type(norm_type)
    by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
    for g in grads:
        by_kind[(g.device, g.dtype)].append(g)
    norms = [
        n.to(device=device, dtype=torch.float64)
        for same in by_kind.values()
        for n in torch._foreach_norm(same, p)
    ]
    # A rank without pieces adds a zero, which changes neither a sum of powers nor a maximum.
    stacked = torch.stack(norms) if norms else torch.zeros(1, dtype=torch.float64, device=device)
    if math.isinf(p):
        # gloo's MAX may drop a NaN (a comparison with NaN is false): it travels as a flag.
        nan = stacked.isnan().any().double()
        local = torch.stack([stacked.masked_fill(stacked.isnan(), 0.0).max(), nan])
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        total = torch.where(local[1] > 0, torch.nan, local[0])
    else:
        total = stacked.pow(p).sum()
        dist.all_reduce(total, group=group)
        total = total.pow(1.0 / p)
    total = total.to(dtype)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"The total norm of order {p} for gradients from `parameters` is non-finite, so it "
            "cannot be clipped. To disable this error and scale the gradients by the "
            "non-finite norm anyway, set `error_if_nonfinite=False`"
        )
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # torch's, in its dtype
    for (kind_device, _), same in by_kind.items():
        torch._foreach_mul_(same, coef.to(kind_device))
    return total
