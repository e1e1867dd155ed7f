"""The data position in a checkpoint's manifest (docs/data-position.md, "Checkpoints").

A checkpoint that continues the optimizer exactly but restarts the data is not a resume, so
both executors store the sampler's cursor (``sampler.state_dict()``: a ``DataCursor``'s JSON)
in the manifest as ``extra["data"]`` when the user passes ``data=sampler`` to a save, and put
it back into ``data=sampler`` on a load. It lives in the manifest, not in a file beside the
checkpoint, so the one atomic switch of a save covers it: no crash can leave a checkpoint
whose data position is one save older than its optimizer state.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gradsync_core.plan._sampler import DataCursor

DATA_KEY = "data"


def check_data_position(value: Any) -> DataCursor:
    """The cursor a manifest's ``extra["data"]`` holds.

    Raises:
        ValueError: if it is not a data cursor's JSON.
    """
    if not isinstance(value, Mapping):
        raise ValueError(
            f"manifest field 'extra.data' is {type(value).__name__} {value!r:.80}, not a data "
            "cursor (a sampler's state_dict()); restore it or save again"
        )
    try:
        return DataCursor.from_json(value)
    except (TypeError, ValueError) as e:
        raise ValueError(f"manifest field 'extra.data' is not a data cursor: {e}") from e


def data_extra(data: Any) -> dict[str, Any]:
    """The manifest entries for ``data`` (a sampler, or ``None``: no entry).

    Raises:
        TypeError: if ``data`` has no ``state_dict()`` returning a data cursor's JSON.
    """
    if data is None:
        return {}
    state_dict = getattr(data, "state_dict", None)
    if not callable(state_dict):
        raise TypeError(
            f"data= takes a sampler with state_dict() (gradsync_torch.ResumableSampler, "
            f"gradsync_jax.ResumableSampler), got {type(data).__name__}"
        )
    return {DATA_KEY: check_data_position(state_dict()).to_json()}


def restore_data(extra: Mapping[str, Any], data: Any, path: str) -> None:
    """Put the stored position into ``data`` (a sampler; ``None``: do nothing).

    Raises:
        ValueError: if the checkpoint at ``path`` holds no data position, or ``data``
            refuses it (another dataset size or seed, see ``load_state_dict``).
    """
    if data is None:
        return
    if DATA_KEY not in extra:
        raise ValueError(
            f"checkpoint {path} holds no data position (it was saved without data=); load it "
            "without data= and position the sampler yourself, or save with data=sampler"
        )
    data.load_state_dict(dict(extra[DATA_KEY]))
