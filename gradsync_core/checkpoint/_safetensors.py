"""The header of a safetensors file, read with a bound (docs/checkpoints.md).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{"<key>": {"dtype", "shape", "data_offsets": [start, stop]}, "__metadata__": {...}}``) and
the tensors' bytes. The header alone says what a file holds, so ``gradsync checkpoint
inspect`` reads nothing else and the JAX executor reads each tensor at its offset; both read
the header here, checked against the file's size before it is read, so a forged length can
neither make a reader allocate gigabytes nor read past the end.

Both executors write their rank files through ``tensor_file``: the header made here and each
tensor's bytes taken as they lie in memory (a live tensor, or a save's staging buffer), never
joined into one serialized copy, which is what a save in the background needs: safetensors'
own ``save`` builds the whole file in one ``bytes`` while holding the GIL, and refuses
tensors that share one buffer.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from gradsync_core.checkpoint._files import open_checkpoint_file

# A header larger than this is not one gradsync wrote (it lists a few keys per parameter).
MAX_HEADER_BYTES = 100 << 20

# Bytes per element of each safetensors dtype, as the safetensors specification names them.
DTYPE_BYTES: Mapping[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True, slots=True)
class TensorBytes:
    """One tensor of a safetensors file to write: its key, safetensors dtype (``"F32"``),
    shape, and its bytes in C order (anything ``memoryview`` takes, C-contiguous)."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    data: Any


def tensor_file(tensors: Sequence[TensorBytes], metadata: Mapping[str, str]) -> list[Any]:
    """The chunks of a safetensors file holding ``tensors`` in the order given: the header,
    then each tensor's bytes, uncopied (``write_rank_file`` writes and hashes them).

    Raises:
        ValueError: an unknown dtype, a repeated or reserved key, or a tensor whose bytes are
            not its shape's.

    Example:
        >>> chunks = tensor_file([TensorBytes("w", "U8", (2,), b"ab")], {"rank": "0"})
        >>> bytes(chunks[0][8:]).decode().rstrip()
        '{"__metadata__":{"rank":"0"},"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}'
    """
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    chunks: list[Any] = []
    offset = 0
    for tensor in tensors:
        if tensor.key in header:
            raise ValueError(f"tensor key {tensor.key!r} is repeated or reserved in a rank file")
        if tensor.dtype not in DTYPE_BYTES:
            raise ValueError(
                f"tensor {tensor.key!r} has dtype {tensor.dtype!r}, not a safetensors one"
            )
        view = memoryview(tensor.data).cast("B")
        nbytes = math.prod(tensor.shape) * DTYPE_BYTES[tensor.dtype]
        if len(view) != nbytes:
            raise ValueError(
                f"tensor {tensor.key!r} of shape {tensor.shape} {tensor.dtype} has {len(view)} "
                f"bytes, expected {nbytes}"
            )
        header[tensor.key] = {
            "dtype": tensor.dtype,
            "shape": list(tensor.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        chunks.append(view)
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
    return [struct.pack("<Q", len(text)) + text, *chunks]


def read_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    """The tensor entries of a safetensors file's header (``__metadata__`` dropped) and the
    offset of its first data byte.

    Raises:
        ValueError: if the file is truncated, its header length exceeds the file or
            ``MAX_HEADER_BYTES``, or the header is not a JSON object.
    """
    header, start = _read_whole_header(path)
    header.pop("__metadata__", None)
    return header, start


def read_metadata(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``__metadata__`` of a safetensors file's header (``{}`` when it has none): what a
    gradsync rank file records about itself (``rank``, ``world``, ``framework``).

    Raises:
        ValueError: as ``read_header``, or if the metadata is not a JSON object.
    """
    header, _ = _read_whole_header(path)
    metadata = header.get("__metadata__", {})
    if not isinstance(metadata, dict):
        raise ValueError(f"checkpoint file {os.fspath(path)} has metadata that is not an object")
    return metadata


def _read_whole_header(path: str | os.PathLike[str]) -> tuple[dict[str, Any], int]:
    path = os.fspath(path)
    directory, name = os.path.split(path)
    with open_checkpoint_file(directory or ".", name) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"checkpoint file {path} is truncated: {size} bytes, no header")
        (length,) = struct.unpack("<Q", head)
        if length > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(
                f"checkpoint file {path} has a header of {length} bytes in a file of {size}"
            )
        try:
            header = json.loads(f.read(length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"checkpoint file {path} has a corrupt header ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"checkpoint file {path} has a header that is not a JSON object")
    return header, 8 + length


def data_range(path: str, key: str, entry: Any, data_bytes: int) -> tuple[int, int]:
    """``[start, stop)`` of tensor ``key``'s bytes within the data section, checked.

    Raises:
        ValueError: if the entry has no valid ``data_offsets`` inside the data section.
    """
    try:
        start, stop = (int(v) for v in entry["data_offsets"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(
            f"checkpoint file {path}: tensor {key!r} has no valid data_offsets"
        ) from None
    if not 0 <= start <= stop <= data_bytes:
        raise ValueError(
            f"checkpoint file {path}: tensor {key!r} spans bytes [{start}, {stop}) of a data "
            f"section of {data_bytes}"
        )
    return start, stop
