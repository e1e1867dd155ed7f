"""Reading a DCP checkpoint without running code from it (docs/interchange.md, design §9).

DCP's ``FileSystemReader`` reads ``.metadata`` with ``pickle.load``, so a downloaded DCP
directory whose ``.metadata`` is a crafted pickle runs whatever it names before any check; and
an entry that the metadata marks as pickled bytes (``BytesStorageMetadata``, how DCP stores an
optimizer's ``param_groups``) is read with ``torch.load(weights_only=False)``. ``import_dcp``
reads through ``read_dcp_metadata`` and ``TensorReader`` instead:

- ``.metadata`` is unpickled by ``_MetadataUnpickler``, which resolves only the globals a DCP
  metadata pickle names (torch 2.13's ``dcp.save``, listed with a recording ``find_class``):
  DCP's metadata dataclasses and its file reader's ``_StorageInfo``, ``torch.Size``, torch
  dtypes and layouts (``torch.serialization._get_layout``), ``pathlib`` paths (the saved
  ``checkpoint_id``) and plain containers; anything else is refused unread, with its name;
- every entry the import reads (``model.*``, ``optim.state.*``) must be a tensor, and every
  file the metadata names must be a regular file in the checkpoint (``open_checkpoint_file``:
  no link out, no FIFO);
- tensors are read by DCP's own ``torch.load(weights_only=True)``; ``TensorReader`` refuses
  any read of pickled bytes, whatever the planner asks.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, BinaryIO

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    StorageMeta,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from gradsync_core.checkpoint import MAX_MANIFEST_BYTES, open_checkpoint_file

_METADATA = "torch.distributed.checkpoint.metadata"
# Every global a DCP metadata pickle names (torch 2.13), and the containers pickle may spell
# as globals under older protocols. Each is a plain constructor: none runs a command, opens
# a file or reaches another global.
_ALLOWED = {
    *(
        (_METADATA, name)
        for name in (
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("pathlib._local", "PosixPath"),  # how Python 3.13 pickles a path
    ("pathlib._local", "PurePosixPath"),
    ("collections", "OrderedDict"),
    *(("builtins", name) for name in ("dict", "list", "tuple", "set", "frozenset")),
}
# What ``import_dcp`` reads: {"model": weights, "optim": {"state": ...}}, flattened by DCP.
READ_PREFIXES = ("model.", "optim.state.")


class _Refused(ValueError):
    """A global outside ``_ALLOWED``: refused before it is resolved."""


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only ``_ALLOWED`` globals and torch dtypes."""

    def __init__(self, file: BinaryIO, shown: str) -> None:
        super().__init__(file)
        self.shown = shown

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED or (
            module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        ):
            return super().find_class(module, name)
        raise _Refused(
            f"DCP checkpoint file {self.shown} refers to {module}.{name}, which is not DCP "
            "metadata: gradsync never runs code from a checkpoint; import only DCP checkpoints "
            "written by torch.distributed.checkpoint.save"
        )


def _unpickle(directory: str, name: str) -> Metadata:
    shown = os.path.join(directory, name)
    with open_checkpoint_file(directory, name) as f:  # a regular file inside, never a FIFO
        raw = f.read(MAX_MANIFEST_BYTES + 1)
    if len(raw) > MAX_MANIFEST_BYTES:
        raise ValueError(f"DCP checkpoint file {shown} is larger than any DCP metadata read here")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(raw), shown).load()
    except _Refused as refused:
        raise ValueError(str(refused)) from None
    except Exception as e:  # truncated, or a constructor given arguments it refuses
        raise ValueError(f"DCP checkpoint file {shown} is corrupt ({e!r})") from None
    if not isinstance(metadata, Metadata):
        raise ValueError(
            f"DCP checkpoint file {shown} holds a {type(metadata).__name__}, not DCP metadata"
        )
    return metadata


def read_dcp_metadata(path: str | os.PathLike[str]) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path``, read without running code and
    checked for what ``import_dcp`` reads: its entries are tensors, its files are regular
    files inside ``path``.

    Raises:
        ValueError: one sentence naming the file and what it holds that is not DCP metadata
            (a global outside DCP's classes), or the entry that is pickled bytes, or the file
            that is missing or not a regular file in the checkpoint.
    """
    directory = os.fspath(path)
    try:
        metadata = _unpickle(directory, ".metadata")
    except FileNotFoundError:
        try:  # DCP's fallback: a save without collectives writes rank 0's own metadata
            metadata = _unpickle(directory, "__0.metadata")
        except FileNotFoundError:
            raise ValueError(
                f"{directory!r} has no .metadata: not a DCP checkpoint written by "
                "torch.distributed.checkpoint.save"
            ) from None
    entries = metadata.state_dict_metadata
    if not isinstance(entries, dict):
        raise ValueError(f"DCP checkpoint {directory!r} has metadata without entries")
    for key, entry in entries.items():
        if isinstance(entry, BytesStorageMetadata) and str(key).startswith(READ_PREFIXES):
            raise ValueError(
                f"DCP checkpoint {directory!r} stores {key!r} as pickled bytes, not a tensor; "
                "gradsync never unpickles, and imports tensors only: export it from the model "
                "and optimizer with dcp.save(get_state_dict(model, optimizer))"
            )
    storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}
    names = {getattr(info, "relative_path", None) for info in storage.values()}
    for name in sorted(names):  # type: ignore[type-var]  # str, or refused just below
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
            raise ValueError(
                f"DCP checkpoint {directory!r} names the data file {name!r}, which is not a "
                "file in the checkpoint"
            )
        try:
            open_checkpoint_file(directory, name).close()
        except FileNotFoundError:
            missing = os.path.join(directory, name)
            raise ValueError(f"DCP checkpoint file {missing} is missing") from None
    return metadata


class TensorReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with metadata that ``read_dcp_metadata`` read and checked:
    it never unpickles ``.metadata`` again, and reads tensors only."""

    def __init__(self, path: str | os.PathLike[str], metadata: Metadata) -> None:
        super().__init__(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.metadata.storage_meta is None:
            self.metadata.storage_meta = StorageMeta()
        self.metadata.storage_meta.load_id = self.load_id
        return self.metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        for item in plan.items:  # DCP reads bytes with torch.load(weights_only=False)
            if item.type == LoadItemType.BYTE_IO:
                raise ValueError(
                    f"DCP checkpoint entry {item.storage_index.fqn!r} is pickled bytes, which "
                    "gradsync never reads"
                )
        return super().read_data(plan, planner)
