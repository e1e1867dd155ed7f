"""Reading safetensors files into NumPy, bfloat16 and float8 included.

gradsync_core reads the header, bounded.
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np

from gradsync_core.checkpoint import data_range, open_checkpoint_file, read_header

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


def read_safetensors(path: str | os.PathLike[str]) -> dict[str, np.ndarray]:
    """Every tensor of a safetensors file, each read at its offset into its own array.

    The header is read with gradsync_core's bound (its length checked against the file's
    size); every entry's offsets must lie in the data section and hold exactly its shape.

    Raises:
        ValueError: naming the file and the entry that is malformed or of an unknown dtype.
    """
    path = os.fspath(path)
    header, start = read_header(path)
    out = {}
    with open_checkpoint_file(*os.path.split(path)) as f:
        data_bytes = os.fstat(f.fileno()).st_size - start
        for key, entry in header.items():
            first, stop = data_range(path, key, entry, data_bytes)
            try:
                dtype, shape = np.dtype(_DTYPES[entry["dtype"]]), tuple(entry["shape"])
                array = np.empty(shape, dtype)
            except (KeyError, TypeError, ValueError) as e:
                raise ValueError(f"checkpoint file {path}: tensor {key!r}: {e!r}") from None
            if array.nbytes != stop - first:
                raise ValueError(
                    f"checkpoint file {path}: tensor {key!r} of shape {shape} {dtype} needs "
                    f"{array.nbytes} bytes, its offsets span {stop - first}"
                )
            f.seek(start + first)
            # An ndarray is a buffer; NumPy's stubs declare __buffer__ from Python 3.12 only.
            target = array.reshape(-1).view(np.uint8)
            if f.readinto(target) != array.nbytes:  # type: ignore[arg-type]
                raise ValueError(f"checkpoint file {path} is truncated in tensor {key!r}")
            out[key] = array
    return out
