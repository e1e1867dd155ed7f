"""The header of a safetensors file, read with a bound (docs/checkpoints.md).

A safetensors file is an 8-byte little-endian header length, a JSON header
(``{"<key>": {"dtype", "shape", "data_offsets": [start, stop]}, "__metadata__": {...}}``) and
the tensors' bytes. The header alone says what a file holds, so ``gradsync checkpoint
inspect`` reads nothing else and the JAX executor reads each tensor at its offset; both read
the header here, checked against the file's size before it is read, so a forged length can
neither make a reader allocate gigabytes nor read past the end.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

from gradsync_core.checkpoint._files import open_checkpoint_file

# A header larger than this is not one gradsync wrote (it lists a few keys per parameter).
MAX_HEADER_BYTES = 100 << 20


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
