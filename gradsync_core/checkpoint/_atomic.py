"""Saves that never destroy the previous checkpoint (docs/design.md §9, "Switching saves").

A checkpoint path ``PATH`` is a symbolic link to a sibling directory ``PATH.v-<token>`` that
holds one complete checkpoint. A save goes through three steps:

1. ``begin_save`` (one process) removes the staging directories of crashed saves and creates
   an empty ``PATH.tmp-<token>``; ``token`` is random and agreed by every rank.
2. Every rank writes its files there (``write_atomic`` fsyncs each one); one process writes the
   manifest last.
3. ``commit_save`` (that process) fsyncs the directory, renames it to ``PATH.v-<token>`` and
   replaces the link ``PATH`` with one ``rename(2)`` of a new link: the only step a reader can
   see, and an atomic one. Superseded ``PATH.v-*`` directories are removed afterwards.

So at every instant ``PATH`` names either the previous complete checkpoint or the new complete
one. A directory named ``.v-`` is always complete; one named ``.tmp-`` never is, is never read,
and is removed by a later save once its writer is gone. A real directory at ``PATH`` (written
before saves switched, or created empty by the user) is adopted: the new link replaces it.

Concurrent saves to one ``PATH`` (two jobs, or a job and its restarted twin) never remove each
other's work (docs/design.md §9, "Concurrent saves"). Two kinds of ``flock`` make that so, and
the kernel drops both when their holder dies, so a crashed save never blocks anyone:

- the *save lock*: the save that opened ``PATH.tmp-<token>`` holds a lock on that directory
  until it is published or removed. A directory whose lock can be taken has no live writer:
  abandoned, so removable. One whose lock cannot be taken is another save in progress: left.
- the *switch lock*, on the hidden file ``.<name>.lock`` beside ``PATH``: held only around
  the short local steps that create a staging directory, publish one and switch ``PATH``,
  and rename what is superseded out of the way; never across a collective, a write or a
  deletion. Under it no other save is between publish and switch, so every ``PATH.v-*`` but
  the one ``PATH`` names is superseded.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
from collections.abc import Iterator

from gradsync_core.checkpoint._format import MANIFEST, RANK_FILE_RE
from gradsync_core.checkpoint._save_hooks import run_hook

STAGING = "tmp"  # PATH.tmp-<token>: being written, never read
COMPLETE = "v"  # PATH.v-<token>: a complete checkpoint; PATH links to one of them
_TOKEN_HEX = 16

# What a checkpoint directory written before saves switched may hold: the manifest, rank files
# and the temporary files of an interrupted ``write_atomic``. Anything else is the user's, and a
# directory holding it is never adopted (adopting removes it once superseded).
_CHECKPOINT_FILE_RE = re.compile(rf"{re.escape(MANIFEST)}|{RANK_FILE_RE.pattern}|\.tmp-.*")


def new_save_token() -> str:
    """A random token naming one save's directories (16 hex digits)."""
    return secrets.token_hex(_TOKEN_HEX // 2)


# staging directory -> the descriptor that holds its save lock, for the saves this process runs
_held: dict[str, int] = {}


def _flock(fd: int, flags: int) -> bool:
    """``flock(fd, flags)``; ``False`` where the file system cannot lock a directory.

    NFS emulates ``flock`` with POSIX locks, which refuse an exclusive lock on a descriptor
    not open for writing (``EBADF``; a directory never is). Saves there work as before this
    protocol: one job per path (docs/design.md §9, "Concurrent saves").
    """
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        raise
    except OSError:  # EBADF, ENOLCK, EOPNOTSUPP: no directory locks here
        return False
    return True


def lock_file(path: str | os.PathLike[str]) -> str:
    """``dir/.ckpt.lock`` for ``dir/ckpt``: the file whose ``flock`` is the switch lock of
    saves to that path. Hidden and empty; it stays (removing it while a save waits on it
    would give two saves two locks)."""
    parent, base = os.path.split(os.fspath(path))
    return os.path.join(parent, f".{base}.lock")


@contextlib.contextmanager
def _switch_lock(path: str) -> Iterator[None]:
    """Hold the switch lock of ``path`` for a few local steps; waits while another save to
    the same path is inside the same steps."""
    fd = os.open(lock_file(path), os.O_RDWR | os.O_CREAT, 0o666)
    try:
        _flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing the descriptor drops the lock


def _hold(staging: str) -> None:
    """Take the save lock of the new ``staging`` directory for this process's save."""
    fd = os.open(staging, os.O_RDONLY)
    _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # new: nobody else can hold it
    _held[staging] = fd


def release_save(staging: str) -> None:
    """Drop this process's save lock of ``staging`` (idempotent). A directory left behind by
    a save cut short is then abandoned, and a later save removes it."""
    fd = _held.pop(staging, None)
    if fd is not None:
        os.close(fd)


def _abandoned(directory: str) -> bool:
    """Whether no live save holds ``directory``'s save lock (its writer is gone).

    The probe's lock is dropped at once: the caller removes ``directory`` under the switch
    lock, and no save takes the lock of an existing directory.
    """
    if os.path.islink(directory):
        return True  # a switch's temporary link, made and replaced under the switch lock
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False  # gone already, or not ours to open: leave it
    try:
        _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # unlockable file system: as before, removed
    except BlockingIOError:
        return False  # a save in progress, in this process or another
    finally:
        os.close(fd)
    return True


def _sibling(path: str, kind: str, token: str) -> str:
    return f"{path}.{kind}-{token}"


def _siblings(path: str) -> list[tuple[str, str]]:
    """``(kind, full path)`` of every ``PATH.tmp-*`` / ``PATH.v-*`` beside ``path``."""
    parent, base = os.path.split(path)
    pattern = re.compile(rf"{re.escape(base)}\.({STAGING}|{COMPLETE})-[0-9a-f]{{{_TOKEN_HEX}}}")
    found = []
    for name in os.listdir(parent):
        match = pattern.fullmatch(name)
        if match:
            found.append((match.group(1), os.path.join(parent, name)))
    return found


def _normalized(path: str | os.PathLike[str]) -> str:
    path = os.path.abspath(os.fspath(path))
    if not os.path.basename(path):
        raise ValueError(f"cannot save a checkpoint at {path!r}: pass a directory name to create")
    return path


def staging_directory(path: str | os.PathLike[str], token: str) -> str:
    """``PATH.tmp-<token>``: where every rank writes its files for save ``token``."""
    return _sibling(_normalized(path), STAGING, token)


def _check_replaceable(path: str) -> None:
    """Refuse a ``path`` that the final switch could not replace without losing user data."""
    if os.path.islink(path):
        target = os.readlink(path)
        if not re.fullmatch(
            rf"{re.escape(os.path.basename(path))}\.{COMPLETE}-[0-9a-f]{{{_TOKEN_HEX}}}", target
        ):
            raise ValueError(
                f"cannot save a checkpoint at {path}: it is a link to {target!r}, which gradsync "
                "did not create; pass the directory it points to, or remove the link"
            )
    elif os.path.isdir(path):
        foreign = sorted(n for n in os.listdir(path) if not _CHECKPOINT_FILE_RE.fullmatch(n))
        if foreign:
            raise ValueError(
                f"cannot save a checkpoint at {path}: the directory holds {len(foreign)} file(s) "
                f"that are not part of a checkpoint (e.g. {foreign[0]!r}); save to a path of "
                "its own"
            )
    elif os.path.lexists(path):
        raise ValueError(f"cannot save a checkpoint at {path}: it is a file, not a directory")


def begin_save(path: str | os.PathLike[str], token: str) -> str:
    """Prepare save ``token`` of checkpoint ``path``; call on one process before any writes.

    Removes the staging directories of saves whose writer is gone (never read, so never
    needed; another live save's is left alone), creates an empty ``PATH.tmp-<token>`` and
    holds its save lock until ``commit_save``, ``discard_save`` or ``release_save``.

    Returns:
        The staging directory.

    Raises:
        ValueError: if ``path`` is a file, a link gradsync did not create, or a directory
            holding files that are not part of a checkpoint.
    """
    path = _normalized(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    staging = _sibling(path, STAGING, token)
    # Under the switch lock: another save's cleanup cannot see our directory between its
    # creation and its lock, nor can ``path`` change between the check and the creation.
    _check_replaceable(path)  # before the lock file exists: a refused path gains nothing
    with _switch_lock(path):
        _check_replaceable(path)  # again: another save may have changed it meanwhile
        stale = [d for kind, d in _siblings(path) if kind == STAGING and _abandoned(d)]
        os.mkdir(staging)
        try:
            _hold(staging)
        except BaseException:
            os.rmdir(staging)
            raise
    for directory in stale:  # abandoned: nobody takes its lock again, so no lock needed
        _remove(directory)
    return staging


def fsync_directory(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (new names, renames) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _publish(staging: str) -> str:
    """Rename the finished staging directory to its complete name; durable on return."""
    path, _, token = staging.rpartition(f".{STAGING}-")
    complete = _sibling(path, COMPLETE, token)
    fsync_directory(staging)
    os.rename(staging, complete)
    fsync_directory(os.path.dirname(complete))
    return complete


def _switch(path: str, complete: str) -> None:
    """Point ``path`` at ``complete`` with one atomic rename of a new link over it."""
    aside = None
    if os.path.isdir(path) and not os.path.islink(path):
        # A real directory cannot be replaced by a rename: move it aside as a superseded
        # version (an empty one is simply removed). This happens once per path, and only
        # here is there an instant at which ``path`` does not exist.
        if os.listdir(path):
            aside = _sibling(path, COMPLETE, new_save_token())
            os.rename(path, aside)
        else:
            os.rmdir(path)
    token = complete.rpartition(f".{COMPLETE}-")[2]
    link = _sibling(path, STAGING, token)  # free again: the staging directory was renamed
    try:
        os.symlink(os.path.basename(complete), link)
        os.replace(link, path)
    except BaseException:
        if os.path.lexists(link):
            os.unlink(link)
        if aside is not None and not os.path.lexists(path):
            os.rename(aside, path)  # put the previous checkpoint back
        raise
    fsync_directory(os.path.dirname(path))


def _retire_superseded(path: str, keep: str) -> list[str]:
    """Under the switch lock: every ``PATH.v-*`` but ``keep`` (the one ``path`` links to; no
    other save is between publish and switch, so the others are superseded or were published
    by a save that died before switching), renamed to an unlocked staging name, and every
    abandoned ``PATH.tmp-*``. The caller removes them once it released the lock: a large
    version takes a while to delete, and nobody needs them any more."""
    doomed = []
    for kind, other in _siblings(path):
        if other == keep:
            continue
        if kind == COMPLETE:
            # Renamed now, so the version vanishes at once for a load still reading it (which
            # then says "removed by a later save; load again", not "file missing"); the
            # staging name has no save lock, so it is abandoned to any later save too.
            retired = _sibling(path, STAGING, other.rpartition(f".{COMPLETE}-")[2])
            os.rename(other, retired)
            doomed.append(retired)
        elif _abandoned(other):
            doomed.append(other)
    return doomed


def _remove(path: str) -> None:
    if os.path.islink(path) or os.path.isfile(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def commit_save(path: str | os.PathLike[str], staging: str) -> None:
    """Make the finished ``staging`` directory the checkpoint at ``path``, atomically.

    Call on one process, after every rank's files and the manifest are in ``staging``. Until
    the final rename, ``path`` still names the previous checkpoint; a failure before it leaves
    that one in place and removes what this save made. Waits while another save to the same
    directory publishes or switches (local renames only; what is superseded is deleted after
    the lock is released).

    Raises:
        OSError: if a rename, link or fsync fails (the previous checkpoint is then intact).
    """
    path = _normalized(path)
    try:
        with _switch_lock(path):
            complete = _publish(staging)
            try:
                run_hook("before_switch")
                _switch(path, complete)
            except BaseException:
                if os.path.realpath(path) != os.path.realpath(complete):
                    _remove(complete)
                raise
            run_hook("after_switch")
            doomed = _retire_superseded(path, keep=complete)
        for retired in doomed:  # outside the lock; a crash here leaves abandoned ones
            _remove(retired)
    finally:
        release_save(staging)


def discard_save(staging: str) -> None:
    """Remove what a failed save staged, then drop its save lock (best effort: a leftover
    is removed by a later save)."""
    try:
        _remove(staging)
    finally:
        release_save(staging)


def resolve_checkpoint(path: str | os.PathLike[str]) -> str:
    """The version directory ``path`` names now, resolved once.

    A load reads the manifest and every file through the returned directory, never through
    ``path`` again: a save that switches ``path`` meanwhile cannot mix two versions into one
    load. (If that save also removes the version being read, the load fails with a sentence
    instead; load again.)
    """
    return os.path.realpath(os.fspath(path))
