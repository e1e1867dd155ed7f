"""Reading and writing a checkpoint directory (docs/design.md §9).

The manifest is written atomically with a checksum over its fields and read back bounded and
checked; rank files are hashed against the manifest and their recorded rank and world size
against their names; a version that a later save removed while it was being read is one
sentence (``reading_version``). The format itself, plain data, is ``_format``.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import mmap
import os
import re
import tempfile
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

from gradsync_core.checkpoint._files import open_checkpoint_file
from gradsync_core.checkpoint._format import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    RANK_FILE_RE,
    Manifest,
    manifest_checksum,
    rank_file_metadata,
)
from gradsync_core.checkpoint._safetensors import read_metadata
from gradsync_core.deprecation import renamed_keywords

try:
    import fcntl
except ImportError:  # not a POSIX system: no direct I/O either
    fcntl = None  # type: ignore[assignment]


def sha256_file(path: str | os.PathLike[str]) -> str:
    """sha256 (hex) of a checkpoint file, which must be a regular file (``_files``)."""
    directory, name = os.path.split(os.fspath(path))
    digest = hashlib.sha256()
    with open_checkpoint_file(directory or ".", name) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def current_umask() -> int:
    """The process's umask, read without changing it where Linux shows it (``os.umask`` can
    only be read by setting it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# Large buffers are hashed and written in slices of this size, each while it is still in the
# CPU's cache; hashlib and the write release the GIL for each slice, so a save writing in the
# background leaves the training thread free (docs/design.md §9, "Asynchronous saves").
_SLICE_BYTES = 8 << 20


def write_atomic(
    path: str | os.PathLike[str],
    data: bytes | Iterable[Any],
    *,
    digest: Any = None,
    direct: bool = False,
) -> None:
    """Write ``data`` to a temp file beside ``path`` and rename it into place, so a reader
    sees the old file or the new one, never half of one.

    Args:
        path: the file to write.
        data: its bytes, or buffers (anything ``memoryview`` takes, C-contiguous: ``bytes``,
            a NumPy ``uint8`` view) written one after the other (iterated once), never joined
            into one copy.
        digest: a ``hashlib`` object updated with every byte written, as it is written.
        direct: write around the kernel's page cache (``O_DIRECT``, through one aligned
            buffer of ``_SLICE_BYTES``) where the file system allows it, else as without it;
            the bytes on disk are the same. What the save's writer process does
            (``_writer_process``): a page-cache write costs the CPU a second copy of the
            bytes, the kernel's writeback and, when the file is removed, freeing its pages,
            all of which a background save takes from training on busy cores.
    """
    chunks: Iterable[Any] = [data] if isinstance(data, bytes) else data
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=os.path.basename(path))
    try:
        # mkstemp creates the file 0600; a checkpoint file gets open()'s mode, 0666 less the
        # umask, as torch.save's and safetensors' files do, so a shared group can read it.
        if hasattr(os, "fchmod"):
            os.fchmod(fd, 0o666 & ~current_umask())
        if not (direct and _write_direct(fd, chunks, digest)):
            with os.fdopen(os.dup(fd), "wb") as f:
                for chunk in chunks:
                    view = memoryview(chunk).cast("B")
                    for start in range(0, len(view), _SLICE_BYTES):
                        piece = view[start : start + _SLICE_BYTES]
                        if digest is not None:
                            digest.update(piece)
                        f.write(piece)
                f.flush()
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


# What O_DIRECT asks of a write's memory, length and file offset: a multiple of the device's
# block, at most 4 KiB on the disks it is meant for (Linux: ``stx_dio_offset_align``).
_DIRECT_ALIGN = 4096


def _write_direct(fd: int, chunks: Iterable[Any], digest: Any) -> bool:
    """Write ``chunks`` to the empty file ``fd`` around the page cache: gathered into one
    page-aligned buffer, each full buffer written with ``O_DIRECT``, the last part (less
    than a block) through the cache. Where the file system refuses ``O_DIRECT`` (when it is
    set, or at the first write), it goes on through the cache: the same bytes either way.
    ``False``: nothing written (no ``O_DIRECT`` here at all), the caller writes as usual."""
    if fcntl is None or not hasattr(os, "O_DIRECT"):  # not Linux
        return False
    flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, flags | os.O_DIRECT)
    except OSError:  # a file system without direct I/O
        return False
    buffer = mmap.mmap(-1, _SLICE_BYTES)  # page-aligned; freed with its last view
    gather, fill = memoryview(buffer), 0
    for chunk in chunks:
        view = memoryview(chunk).cast("B")
        while view:
            take = min(len(view), _SLICE_BYTES - fill)
            gather[fill : fill + take] = view[:take]
            if digest is not None:  # the copy just made, while it is in the CPU's cache
                digest.update(gather[fill : fill + take])
            view, fill = view[take:], fill + take
            if fill == _SLICE_BYTES:
                _write_all(fd, gather, flags)
                fill = 0
    whole = fill - fill % _DIRECT_ALIGN
    _write_all(fd, gather[:whole], flags)
    fcntl.fcntl(fd, fcntl.F_SETFL, flags)  # the tail, less than a block: through the cache
    _write_all(fd, gather[whole:fill], flags)
    return True


def _write_all(fd: int, data: memoryview, flags: int) -> None:
    """Write all of ``data`` at ``fd``'s position, looping over short writes; a direct write
    refused (``EINVAL``: its alignment is not the file system's) goes on through the page
    cache (``flags``: ``fd``'s without ``O_DIRECT``)."""
    assert fcntl is not None
    done = 0
    while done < len(data):
        try:
            done += os.write(fd, data[done:])
        except OSError as e:
            if e.errno != errno.EINVAL or not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
                raise
            fcntl.fcntl(fd, fcntl.F_SETFL, flags)


@renamed_keywords(directory="path")
def write_manifest(path: str | os.PathLike[str], manifest: Manifest) -> None:
    """Write ``manifest.json`` into the checkpoint directory ``path`` atomically, with a
    ``"checksum"`` over its other fields."""
    # Through JSON and back first, so the checksum covers exactly what a reader will parse
    # (tuples become lists, int keys strings).
    obj = json.loads(json.dumps(manifest.to_json()))
    obj["checksum"] = manifest_checksum(obj)
    text = json.dumps(obj, indent=1, sort_keys=True)
    write_atomic(os.path.join(path, MANIFEST), text.encode("utf-8"))


@renamed_keywords(directory="path")
def read_manifest(path: str | os.PathLike[str], *, verify_files: bool = True) -> Manifest:
    """Read and check a checkpoint's manifest (and, by default, every rank file's hash).

    The manifest's own checksum and every field are checked before anything is loaded.

    Args:
        path: the checkpoint directory.
        verify_files: also check every rank file against its recorded hash.

    Returns:
        The manifest.

    Raises:
        ValueError: if the manifest is missing, unreadable, edited, holds a field of the
            wrong type, or a file is missing or corrupt.
    """
    shown = os.path.join(path, MANIFEST)
    try:
        with open_checkpoint_file(path, MANIFEST) as f:
            raw = f.read(MAX_MANIFEST_BYTES + 1)
        if len(raw) > MAX_MANIFEST_BYTES:
            raise ValueError(
                f"{shown} is larger than {MAX_MANIFEST_BYTES >> 20} MiB, which no gradsync "
                "manifest is; restore it or save again"
            )
        obj = json.loads(raw.decode("utf-8"))
    except FileNotFoundError:
        _refuse_if_removed(path)
        raise ValueError(
            f"{path!s} has no {MANIFEST}: not a gradsync checkpoint, or its save did not finish"
        ) from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{shown} is corrupt ({e}); restore it or save again") from None
    # Manifests written before the checksum existed have none; they are accepted, and still
    # get every field check below. A manifest that has one must match it.
    if isinstance(obj, Mapping) and "checksum" in obj:
        if obj["checksum"] != manifest_checksum(obj):
            raise ValueError(
                f"{shown} does not match its own checksum: edited by hand or corrupt; "
                "restore it or save again"
            )
    try:
        manifest = Manifest.from_json(obj)
    except ValueError as e:
        raise ValueError(f"{shown}: {e}") from None
    except (KeyError, TypeError) as e:  # a shape the field checks did not foresee
        raise ValueError(f"{shown} is corrupt ({e!r}); restore it or save again") from None
    if verify_files:
        verify_file_hashes(path, manifest)
    return manifest


# A version directory of a switching save (``PATH.v-<16 hex>``, _atomic.py).
_VERSION_DIR_RE = re.compile(r".+\.v-[0-9a-f]{16}")


def _removed(directory: str | os.PathLike[str]) -> bool:
    """Whether ``directory`` is a version of a switching save that is gone (a later save
    removed it: renamed to a ``.tmp-`` name, then deleted)."""
    name = os.path.basename(os.fspath(directory))
    return bool(_VERSION_DIR_RE.fullmatch(name)) and not os.path.isdir(directory)


def _removed_sentence(directory: str | os.PathLike[str]) -> str:
    return (
        f"checkpoint {os.fspath(directory)} was removed by a later save while it was being "
        "read; load again"
    )


def _refuse_if_removed(directory: str | os.PathLike[str]) -> None:
    """A version directory that vanished while it was read was removed by a later save
    (docs/design.md §9): say so, instead of calling the checkpoint incomplete."""
    if _removed(directory):
        raise ValueError(_removed_sentence(directory)) from None


@renamed_keywords(directory="path")
@contextlib.contextmanager
def reading_version(path: str | os.PathLike[str]) -> Iterator[None]:
    """Where a load reads a resolved version: a version removed meanwhile is one sentence.

    Every read of a version ``path`` (``resolve_checkpoint``) runs inside it. A failure
    while a later save removed that version, whatever a reader raised for its vanished files
    (``FileNotFoundError``, safetensors' ``unable to open file``, a missing manifest), becomes
    the documented sentence ``checkpoint PATH.v-... was removed by a later save while it was
    being read; load again`` (docs/design.md §9). Any other failure passes unchanged.

    Raises:
        ValueError: that sentence, with the reader's error as its cause.
    """
    try:
        yield
    except Exception as err:
        if _removed(path):
            raise ValueError(_removed_sentence(path)) from err
        raise


@renamed_keywords(directory="path")
def verify_file_hashes(
    path: str | os.PathLike[str], manifest: Manifest, files: Sequence[str] | None = None
) -> None:
    """Check rank files against the sha256 the manifest recorded for them.

    Args:
        path: the checkpoint directory.
        manifest: its manifest, as returned by ``read_manifest``.
        files: the rank files to check (default: every file the manifest lists). A rank that
            reads only some files can check those plus its share of the rest, so that together
            the ranks check every file once.

    Raises:
        ValueError: naming the first file that is missing, unlisted or does not match.
    """
    for name in manifest.files if files is None else files:
        file_path = os.path.join(path, name)
        if name not in manifest.files:
            raise ValueError(f"checkpoint file {file_path} is not listed in its manifest")
        try:
            digest = sha256_file(file_path)  # refuses a FIFO, device or link out, unread
        except FileNotFoundError:
            _refuse_if_removed(path)
            raise ValueError(f"checkpoint file {file_path} is missing") from None
        if digest != manifest.files[name]:
            raise ValueError(
                f"checkpoint file {file_path} does not match its manifest hash: corrupt or "
                "from another save"
            )
        check_rank_file(path, name)


@renamed_keywords(directory="path")
def hash_share(
    path: str | os.PathLike[str], manifest: Manifest, index: int, count: int
) -> list[str]:
    """The rank files reader ``index`` of ``count`` hashes (``verify_file_hashes(files=)``)
    so that together the readers hash every file once, with about equal bytes each.

    Largest file first, each goes to the reader with the fewest bytes so far (ties: the
    lowest index). The sizes are the files' own, the same for every reader of one file system;
    a file that cannot be stat-ed counts 0 bytes (its reader then finds it missing).

    Args:
        path: the checkpoint version.
        manifest: its manifest (``files`` names them).
        index: this reader's index.
        count: the number of readers.

    Returns:
        This reader's files, sorted by name.
    """
    sizes = {}
    for name in sorted(manifest.files):
        try:
            sizes[name] = os.stat(os.path.join(path, name)).st_size
        except OSError:
            sizes[name] = 0
    loads, mine = [0] * count, []
    for name in sorted(sizes, key=lambda n: -sizes[n]):  # stable: equal sizes in name order
        reader = loads.index(min(loads))
        loads[reader] += sizes[name]
        if reader == index:
            mine.append(name)
    return sorted(mine)


@renamed_keywords(directory="path")
def check_rank_file(path: str | os.PathLike[str], name: str) -> None:
    """Refuse a rank file whose recorded rank and world size are not those of its name.

    Hashes alone cannot tell two rank files that trade places with the manifest's hashes
    redone (a copy gone wrong, a "repaired" download): under a flat or dim-0 plan their slices
    are often equally long, and every rank would silently take another's rows. A rank file
    records neither only if JAX wrote it before rank files recorded them; it is read as named
    (docs/design.md §9).

    Raises:
        ValueError: naming the file, what it records and what to do.
    """
    match = RANK_FILE_RE.fullmatch(name)
    if match is None:
        raise ValueError(f"checkpoint file {name!r} is not a rank file's name")
    file_path = os.path.join(path, name)
    metadata = read_metadata(file_path)
    recorded = (metadata.get("rank"), metadata.get("world"))
    if recorded == (None, None):
        return
    named = rank_file_metadata(int(match.group(1)), int(match.group(2)))
    if recorded != (named["rank"], named["world"]):
        rank, world = (v if isinstance(v, str) and v.isdigit() else repr(v) for v in recorded)
        raise ValueError(
            f"checkpoint file {file_path} records rank {rank} of {world} but is named for rank "
            f"{named['rank']} of {named['world']}: rank files were swapped or renamed; restore "
            "them or save again"
        )
