"""One sentence for a collective of ``DataParallel`` that a peer never completed.

The runtime agreement (``sync_agreement.py``) rides in the sync's own collective, so it cannot
catch a rank that never issues that collective: one that ran out of batches and went on to a
barrier, a save or the end of its script, or one that died. The backend's error is then the
only signal, and it names neither the sync nor the cause. Two cases, told apart by what gloo
says (NCCL raises a ``DistBackendError`` for both):

- the connection was closed or reset: the peer process died or ended (its log has the first
  error; a rank whose script ended early closes its connections too);
- a timeout: the peer is alive but elsewhere, most often in a barrier after its loop, or in
  a sync of its own while this rank is in a buffer broadcast.

The backend's first line is kept whole at the end, so the path and line in gloo's sources stay
readable.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from gradsync_torch._collectives import peer_closed, peer_failed


def peer_failure_error(what: str, cause: BaseException) -> RuntimeError | None:
    """The sentence for ``what`` (e.g. "gradient sync #3") failing because a peer left, or
    ``None`` if ``cause`` is not such a failure (it then propagates unchanged)."""
    text = str(cause).strip()
    first_line = text.splitlines()[0] if text else type(cause).__name__
    if peer_closed(cause):
        return RuntimeError(
            f"DataParallel: {what} failed because another rank of the group closed its "
            "connection: that process died or ended; look for the first error in its log (a "
            "rank that ran out of batches and reached the end of its script ends this way "
            "too: give every rank the same number of steps, or wrap the loop in "
            f"`with model.join():`) (backend: {first_line})"
        )
    if peer_failed(cause):
        return RuntimeError(
            f"DataParallel: {what} did not complete within the process group's timeout "
            "because another rank of the group never reached it (most often that rank ran out "
            "of batches and left its loop, or took fewer steps, and now waits in a collective "
            "of its own, such as a barrier); give every rank the same number of steps, or "
            f"wrap the loop in `with model.join():` for uneven inputs (backend: {first_line})"
        )
    return None


@contextmanager
def naming_peer_failures(what: str) -> Iterator[None]:
    """Re-raise a peer failure inside the block as ``peer_failure_error(what, ...)``."""
    try:
        yield
    except RuntimeError as e:
        named = peer_failure_error(what, e)
        if named is None:
            raise
        raise named from e
