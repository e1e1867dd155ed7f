"""``DataParallel(check_finite=True)``: a non-finite gradient names its ranks and parameters.

Issue 21, item 6; docs/torch-data-parallel.md, "Finding a NaN gradient".

DDP averages a NaN from one rank into every rank's gradients and says nothing; the step
after, every parameter it touched is NaN and nobody knows where it started. This check rides
on the all-reduce that already runs: NaN and inf survive a sum, so the reduced bucket is
non-finite on every rank as soon as any rank's input was, and every rank reaches the same
verdict without a collective of its own. Per bucket and sync it keeps two device scalars:

- before the launch, whether this rank's own contribution was finite (``local``);
- after the collective, whether the reduced bucket is finite (``reduced``).

Both are one read of the bucket (its minimum and maximum, which NaN and inf reach exactly).
The host looks at them once, at the end of the sync (``verify``); only when a reduced bucket
is non-finite does it all-gather the local flags, to name the ranks whose own gradient was
non-finite, and read the written-back gradients, to name the parameters. Then every rank
raises the same sentence.

ZeRO-2 (``shard_gradients=True``) reduce-scatters: each rank sees only its shard of the sum,
so the ranks' verdicts could differ; the check is refused there (``DataParallelOptions``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import nn

from gradsync_torch.data_parallel.buckets import BucketBuffers

_NAMED = 5  # parameters named in the message; the rest are counted


def _finite(values: torch.Tensor) -> torch.Tensor:
    """A device scalar: whether every element of ``values`` is finite (no host sync).

    One read and no bucket-sized temporary: the minimum and maximum propagate NaN and are
    infinite exactly when some element is (a float64 sum would be exact too, but converting
    every element made it 30x slower on the CPU; ``isfinite().all()`` writes a mask).
    """
    low, high = torch.aminmax(values)
    return torch.isfinite(low) & torch.isfinite(high)


class FiniteCheck:
    """The per-sync flags of ``check_finite=True`` and the failure's sentence.

    Args:
        group: the data-parallel group (the failure path's all-gather runs on it).
        names: parameter names by slot, for the message.
        params: the trainable parameters by slot.
    """

    def __init__(
        self, group: dist.ProcessGroup, names: Sequence[str], params: Sequence[nn.Parameter]
    ) -> None:
        self.group = group
        self.names = list(names)
        self.params = list(params)
        self._local: dict[int, torch.Tensor] = {}
        self._reduced: dict[int, torch.Tensor] = {}

    def local(self, bucket: BucketBuffers) -> None:
        """``bucket`` holds this rank's contribution, not launched yet."""
        self._local[bucket.spec.index] = _finite(bucket.buffer)

    def reduced(self, bucket: BucketBuffers) -> None:
        """``bucket``'s collective finished: it holds the reduced gradients."""
        self._reduced[bucket.spec.index] = _finite(bucket.buffer)

    def verify(self, sync: int) -> None:
        """The sync is over (gradients written back): raise on every rank if any reduced
        bucket was non-finite; on the good path this is one host read of a few scalars.

        Raises:
            FloatingPointError: naming the ranks whose own gradients were non-finite and the
                parameters whose reduced gradients are.
        """
        local, reduced = self._local, self._reduced
        self._local, self._reduced = {}, {}
        if not reduced or bool(torch.stack(list(reduced.values())).all()):
            return
        # The failure path: every rank is here (the reduced buckets are the same everywhere).
        order = sorted(local)
        mine = torch.stack([local[i] for i in order]).to(torch.uint8)
        gathered = [torch.empty_like(mine) for _ in range(self.group.size())]
        dist.all_gather(gathered, mine, group=self.group)
        ranks = [
            dist.get_global_rank(self.group, r)
            for r, flags in enumerate(gathered)
            if not bool(flags.all())
        ]
        raise FloatingPointError(self._message(sync, ranks))

    def _message(self, sync: int, ranks: list[int]) -> str:
        bad = [
            name
            for name, param in zip(self.names, self.params, strict=True)
            if param.grad is not None and not bool(torch.isfinite(param.grad).all())
        ]
        shown = ", ".join(repr(n) for n in bad[:_NAMED])
        if len(bad) > _NAMED:
            shown += f" and {len(bad) - _NAMED} more"
        where = (
            f"rank(s) {ranks} sent non-finite gradients"
            if ranks
            else "no rank's own gradient was, so the reduction overflowed"
        )
        return (
            f"check_finite: the reduced gradient of {shown or 'a parameter'} is NaN or "
            f"infinite after sync {sync}: {where}; find what made them so (a learning rate, "
            "a loss scale, bad data on that rank) or skip this step (zero_grad) and go on"
        )

    def reset(self) -> None:
        """A backward was abandoned: forget its flags."""
        self._local, self._reduced = {}, {}
