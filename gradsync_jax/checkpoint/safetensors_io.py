"""Reading safetensors headers and element ranges into NumPy, bfloat16 and float8 included.

gradsync_core reads the header, bounded. A tensor's elements ``[start, stop)``, flattened, are
one contiguous byte range of its file (the tensors are row-major), so a load reads just the
ranges it keeps (``gradsync_core.checkpoint.state_reads``): a seek and a ``readinto`` of that
many bytes.
"""

from __future__ import annotations

import os
from typing import BinaryIO, NamedTuple

import ml_dtypes
import numpy as np

from gradsync_core.checkpoint import data_range, read_header

# safetensors dtype names -> NumPy; safetensors.numpy.load has no bfloat16 (it raises
# KeyError 'BF16'), while its save writes BF16 correctly and torch reads it.
_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,
    "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


class TensorEntry(NamedTuple):
    """One tensor of a safetensors file: its dtype, shape and first byte in the file."""

    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    def stand_in(self) -> np.ndarray:
        """An array of this shape and dtype that holds no data (a broadcast 0-d zero): what
        the checks of shapes and dtypes need before anything is read."""
        return np.broadcast_to(np.zeros((), self.dtype), self.shape)


def read_entries(path: str | os.PathLike[str]) -> dict[str, TensorEntry]:
    """Every tensor entry of a safetensors file's header, checked; no tensor data is read.

    The header is read with gradsync_core's bound (its length checked against the file's
    size); every entry's offsets must lie in the data section and hold exactly its shape.

    Raises:
        ValueError: naming the file and the entry that is malformed or of an unknown dtype.
    """
    path = os.fspath(path)
    header, start = read_header(path)
    data_bytes = os.path.getsize(path) - start
    out = {}
    for key, entry in header.items():
        first, stop = data_range(path, key, entry, data_bytes)
        try:
            dtype, shape = np.dtype(_DTYPES[entry["dtype"]]), tuple(int(d) for d in entry["shape"])
            if any(d < 0 for d in shape):
                raise ValueError(f"negative dimension in {shape}")
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"checkpoint file {path}: tensor {key!r}: {e!r}") from None
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes != stop - first:
            raise ValueError(
                f"checkpoint file {path}: tensor {key!r} of shape {shape} {dtype} needs "
                f"{nbytes} bytes, its offsets span {stop - first}"
            )
        out[key] = TensorEntry(dtype, shape, start + first)
    return out


def read_elements(
    f: BinaryIO, path: str, key: str, entry: TensorEntry, start: int, stop: int, out: np.ndarray
) -> None:
    """Read elements ``[start, stop)`` of the flattened tensor ``key`` of the open file ``f``
    into ``out`` (contiguous, of the tensor's dtype, ``stop - start`` elements).

    Raises:
        ValueError: if the range is not inside the tensor, or the file ends before it.
    """
    if not 0 <= start <= stop <= entry.numel:
        raise ValueError(
            f"checkpoint file {path}: tensor {key!r} has {entry.numel} elements, not "
            f"[{start}, {stop})"
        )
    assert out.dtype == entry.dtype and out.size == stop - start and out.flags.c_contiguous
    f.seek(entry.offset + start * entry.dtype.itemsize)
    # An ndarray is a buffer; NumPy's stubs declare __buffer__ from Python 3.12 only.
    if f.readinto(out.reshape(-1).view(np.uint8)) != out.nbytes:  # type: ignore[attr-defined]
        raise ValueError(f"checkpoint file {path} is truncated in tensor {key!r}")
