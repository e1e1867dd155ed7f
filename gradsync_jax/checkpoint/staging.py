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

from collections.abc import Callable, Mapping, Sequence
from typing import Any

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
        returns views of it in the same layout. Each copy keeps its array's memory order (C,
        or F for a kernel seen transposed in torch's layout), so it runs at memory speed and
        the save returns sooner; the write makes the bytes C-ordered, in the background. The
        previous views are overwritten: call only once their save has ended."""
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
                fortran = array.flags.f_contiguous and not array.flags.c_contiguous
                view = self._buffer[start : start + array.nbytes].view(array.dtype)
                view = view.reshape(array.shape, order="F" if fortran else "C")
                np.copyto(view, array)
                staged[rank][key] = view
        return staged

    def allocator(
        self, arrays: Sequence[tuple[tuple[int, ...], Any]]
    ) -> Callable[[tuple[int, ...], Any], np.ndarray]:
        """Make room for ``arrays`` (each ``(shape, dtype)``, in the order they will be
        taken) and return ``take(shape, dtype)``, which hands out their views of the buffer
        in that order (``processes.copied_view`` fills them). The previous views are
        overwritten: call only once their save has ended.

        Raises:
            ValueError: ``take`` asked for more than was reserved.
        """
        places, needed = [], 0
        for shape, dtype in arrays:
            size = np.dtype(dtype).itemsize  # a view of another dtype must align
            needed = -(-needed // size) * size
            places.append(needed)
            needed += int(np.prod(shape, dtype=np.int64)) * size
        if self._buffer is None or self._buffer.size < needed:
            self._buffer = None  # the old one is freed before the new one is allocated
            self._buffer = np.empty(needed, np.uint8)
        buffer, taken = self._buffer, iter(zip(places, arrays, strict=True))

        def take(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
            start, (want, want_dtype) = next(taken, (-1, ((), None)))
            if start < 0 or tuple(want) != tuple(shape) or np.dtype(want_dtype) != dtype:
                raise ValueError(f"staging was not reserved for an array {shape} {dtype}")
            nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            return buffer[start : start + nbytes].view(dtype).reshape(shape)

        return take


# The process's staging buffer: one save in flight at a time, so one buffer.
STAGING = StagingBuffer()
