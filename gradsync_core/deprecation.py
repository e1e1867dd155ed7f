"""Old spellings kept working: each warns once per process, then acts as the new one.

A renamed function or keyword keeps its old name as an alias (docs/design.md §13 lists them).
The first use of an old name in a process emits one ``DeprecationWarning`` (torch's and
``typing_extensions.deprecated``'s category) naming the new spelling; later uses are silent.
Used by the core and both executors, so every alias warns the same way.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# The old names that already warned in this process.
_warned: set[str] = set()


def warn_deprecated(old: str, new: str, *, stacklevel: int = 3) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``, the first time only.

    Args:
        old: the old spelling, as the user wrote it (``"save_fully_sharded"``,
            ``"hsdp_mesh(shard_size=)"``).
        new: what to write instead.
        stacklevel: ``warnings.warn``'s, so the warning points at the user's line.
    """
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed: use {new}",
        DeprecationWarning,
        stacklevel=stacklevel,
    )


def renamed_keyword(where: str, old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """The value of keyword ``new`` of ``where``, given under either spelling.

    ``None`` means "not given" for both; the old spelling warns once.

    Raises:
        TypeError: if both spellings were given.

    Example:
        >>> renamed_keyword("f", "shard_size", None, "dp_shard", 4)
        4
    """
    if old_value is None:
        return new_value
    if new_value is not None:
        raise TypeError(f"{where}() got {new}= and its deprecated spelling {old}=; pass {new}=")
    warn_deprecated(f"{where}({old}=)", f"{where}({new}=)", stacklevel=4)
    return old_value


def deprecated_alias(func: F, old: str) -> F:
    """``func`` under its old name ``old``: the same call, which warns once first.

    Example:
        >>> def save_param_shards(path): return path
        >>> save_fully_sharded = deprecated_alias(save_param_shards, "save_fully_sharded")
    """

    @functools.wraps(func)
    def alias(*args: Any, **kwargs: Any) -> Any:
        warn_deprecated(old, func.__name__)
        return func(*args, **kwargs)

    alias.__name__ = alias.__qualname__ = old
    alias.__doc__ = f"Deprecated alias of ``{func.__name__}``: the same call, which warns once."
    return alias  # type: ignore[return-value]
