"""What a rank file is written from: arrays' bytes as they lie, or a save's staging buffer.

A blocking save writes each array's bytes straight from the host array (``tensor_bytes``: no
serialized copy of the file). A save with ``blocking=False`` returns before the write, while
training goes on (and may donate the device buffers the host copies came from), so it first
copies the tensors of the rank files this process writes into ``STAGING``: host memory
allocated at the first such save and reused by every later one (the same bytes each save: the
plan says which, ``gradsync plan --zero N`` prints how many), grown only when a save needs
more. At most one save is in flight per process (``gradsync_core.checkpoint.wait_for_saves``),
so one buffer per process serves them all.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from gradsync_core.checkpoint import TensorBytes
from gradsync_jax.checkpoint.safetensors_io import SAFETENSORS_NAMES


def tensor_bytes(tensors: Mapping[str, np.ndarray]) -> list[TensorBytes]:
    """The tensors of a rank file, each as its bytes in C order (no copy but for an array
    that is not C-contiguous), for ``gradsync_core.checkpoint.tensor_file``.

    Raises:
        ValueError: a dtype safetensors cannot store.
    """
    out = []
    for key, array in tensors.items():
        array = np.asarray(array)
        name = SAFETENSORS_NAMES.get(array.dtype)
        if name is None:
            raise ValueError(
                f"tensor {key!r} has dtype {array.dtype}, which safetensors cannot store"
            )
        data = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        out.append(TensorBytes(key, name, tuple(array.shape), data))
    return out


class StagingBuffer:
    """Host memory that saves with ``blocking=False`` copy the rank files' tensors into;
    allocated once, reused, grown only when a save needs more (``nbytes``: its size now)."""

    def __init__(self) -> None:
        self._buffer: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        """Bytes allocated (0 before the first save without blocking)."""
        return 0 if self._buffer is None else int(self._buffer.size)

    def stage(
        self, files: Mapping[int, Mapping[str, np.ndarray]]
    ) -> dict[int, dict[str, np.ndarray]]:
        """Copy every tensor of ``files`` (rank -> key -> array, any strides) into the buffer;
        returns C-contiguous views of it in the same layout. The previous views are
        overwritten: call only once their save has ended."""
        offsets, needed = {}, 0
        for rank, tensors in files.items():
            for key, array in tensors.items():
                size = np.dtype(array.dtype).itemsize  # a view of another dtype must align
                needed = -(-needed // size) * size
                offsets[rank, key] = needed
                needed += int(np.asarray(array).nbytes)
        if self._buffer is None or self._buffer.size < needed:
            self._buffer = None  # the old one is freed before the new one is allocated
            self._buffer = np.empty(needed, np.uint8)
        staged: dict[int, dict[str, np.ndarray]] = {}
        for rank, tensors in files.items():
            staged[rank] = {}
            for key, array in tensors.items():
                array = np.asarray(array)
                start = offsets[rank, key]
                view = self._buffer[start : start + array.nbytes].view(array.dtype)
                view = view.reshape(array.shape)
                np.copyto(view, array)
                staged[rank][key] = view
        return staged


# The process's staging buffer: one save in flight at a time, so one buffer.
STAGING = StagingBuffer()
