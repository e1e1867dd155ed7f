"""Opening a checkpoint's files as what they claim to be (docs/design.md §9, §15).

A checkpoint may come from a download or another user. A rank file that is a link to
``/dev/zero`` or a FIFO would make the hashing rank block forever (and the other ranks wait
for the process-group timeout); a manifest linked to ``/dev/zero`` would grow memory without
bound; a link to a file outside the checkpoint would read it. Every file of a checkpoint is
therefore opened here: it must be a regular file inside the checkpoint's resolved directory
(a link is followed only when it stays inside), checked on the opened descriptor itself, and
opened without blocking, so that a FIFO is refused instead of waited on.
"""

from __future__ import annotations

import io
import os
import stat

from gradsync_core.deprecation import renamed_keywords

_KINDS = {
    stat.S_IFDIR: "a directory",
    stat.S_IFIFO: "a FIFO",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


@renamed_keywords(directory="path")
def open_checkpoint_file(path: str | os.PathLike[str], name: str) -> io.BufferedReader:
    """Open ``path/name`` for reading, refusing anything but a regular file inside the
    checkpoint directory ``path``.

    Raises:
        FileNotFoundError: if the file does not exist (callers say what that means).
        ValueError: one sentence naming the file and what it is instead (a link out of the
            checkpoint, a link loop, a directory, a FIFO, a device).
    """
    root = os.path.realpath(os.fspath(path))
    shown = os.path.join(os.fspath(path), name)
    target = os.path.realpath(os.path.join(root, name))
    if os.path.commonpath([root, target]) != root:
        raise ValueError(
            f"checkpoint file {shown} is a link to {target}, outside the checkpoint {root}; "
            "copy the file into the checkpoint or restore it"
        )
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a link loop; EACCES, ...
        raise ValueError(f"checkpoint file {shown} cannot be opened ({e.strerror})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise ValueError(
            f"checkpoint file {shown} is {kind}, not a regular file; restore it or save again"
        )
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")
