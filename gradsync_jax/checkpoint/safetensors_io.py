"""Reading safetensors files into NumPy, bfloat16 and float8 included."""

from __future__ import annotations

import json
import os
import struct

import ml_dtypes
import numpy as np

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
    """Every tensor of a safetensors file (format: u64 header size, JSON header, data)."""
    with open(path, "rb") as f:
        data = f.read()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + size])
    header.pop("__metadata__", None)
    body = memoryview(data)[8 + size :]
    out = {}
    for key, entry in header.items():
        start, stop = entry["data_offsets"]
        array = np.frombuffer(body[start:stop], dtype=_DTYPES[entry["dtype"]])
        out[key] = array.reshape(entry["shape"]).copy()
    return out
