"""Old spellings kept working: each warns once per process, then acts as the new one.

A renamed function or keyword keeps its old name as an alias (docs/design.md §13 lists them).
The first use of an old name in a process emits one ``DeprecationWarning`` (torch's and
``typing_extensions.deprecated``'s category) naming the new spelling; later uses are silent.
Used by the core and both executors, so every alias warns the same way.

An alias declares itself where it is made: ``renamed_keywords`` records its renames on the
function (``__renamed_keywords__``) and ``deprecated_alias`` the name it stands for
(``__deprecated_alias_of__``); ``deprecated_keywords`` declares the old keywords a function
still shows because it converts them itself. The API's list of old spellings is therefore a walk
over the exported names (docs/gen_names.py writes §13's table from it; tests/test_vocabulary.py
checks that no exported signature shows a retired word).
"""

from __future__ import annotations

import functools
import inspect
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

# The old names that already warned in this process.
_warned: set[str] = set()

# Frames of gradsync's packages (the core and any executor: every top-level package named
# ``gradsync_*``) are the alias's (its wrappers, the function), not the caller's. The core names
# no executor (docs/design.md §1), so the rule is the prefix.
_OURS_PREFIX = "gradsync_"


def _caller_level() -> int:
    """``warnings.warn``'s stacklevel of the first frame outside gradsync, seen from
    ``warn_deprecated``: the user's line, however many wrappers an alias passes through."""
    frame: FrameType | None = sys._getframe(2)  # warn_deprecated's caller: warn's level 2
    level = 2
    while frame is not None and frame.f_globals.get("__name__", "").startswith(_OURS_PREFIX):
        frame, level = frame.f_back, level + 1
    return level


def warn_deprecated(old: str, new: str, *, stacklevel: int | None = None) -> None:
    """Warn that ``old`` is deprecated in favour of ``new``, the first time only.

    Args:
        old: the old spelling, as the user wrote it (``"save_fully_sharded"``,
            ``"hsdp_mesh(shard_size=)"``).
        new: what to write instead.
        stacklevel: ``warnings.warn``'s; default: the first caller outside gradsync, so the
            warning points at the user's line.
    """
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed: use {new}",
        DeprecationWarning,
        stacklevel=_caller_level() if stacklevel is None else stacklevel,
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
    warn_deprecated(f"{where}({old}=)", f"{where}({new}=)")
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
    alias.__deprecated_alias_of__ = func.__name__  # type: ignore[attr-defined]
    return alias  # type: ignore[return-value]


def _where(func: Callable[..., Any]) -> str:
    """How a warning names ``func``: ``load_params``, ``Zero3Step`` for its ``__init__``,
    ``ZeroRedundancyOptimizer.load`` for another method."""
    name = func.__qualname__.rpartition("<locals>.")[2]  # a class made in a function: its name
    return name.removesuffix(".__init__")


def renamed_keywords(**renames: str) -> Callable[[F], F]:
    """Decorator: the function takes each old keyword (an argument's name) as the new one
    (its value); the first use of an old one warns once. The signature (``inspect``,
    ``help``, docs/api.md) shows only the new names.

    Args:
        **renames: ``old="new"`` per renamed keyword.

    Returns:
        The decorator; the function it returns carries ``__renamed_keywords__``.

    Raises:
        TypeError: (from the decorated function) both spellings of one keyword given.

    Example:
        >>> @renamed_keywords(directory="path")
        ... def read(path):
        ...     return path
        >>> read(path="ckpt")
        'ckpt'
        >>> read.__renamed_keywords__
        {'directory': 'path'}
    """

    def decorate(func: F) -> F:
        where = _where(func)
        # How many positional arguments reach each new name (a new name given positionally
        # and its old one as a keyword is both spellings too).
        params = list(inspect.signature(func).parameters.values())
        positional = {
            p.name: i
            for i, p in enumerate(params)
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        }

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in renames.items():  # in declaration order: warnings in one order
                if old not in kwargs:
                    continue
                if new in kwargs or len(args) > positional.get(new, len(args)):
                    raise TypeError(
                        f"{where}() got {new}= and its deprecated spelling {old}=; pass {new}="
                    )
                warn_deprecated(f"{where}({old}=)", f"{where}({new}=)")
                kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        inner = getattr(func, "__renamed_keywords__", {})
        wrapper.__renamed_keywords__ = {**inner, **renames}  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def deprecated_keywords(**replacements: str) -> Callable[[F], F]:
    """Decorator that declares old keywords the function still shows and converts itself
    (calling ``warn_deprecated`` or ``renamed_keyword``): not a rename, a change of meaning,
    such as ``replicate_size=R`` for ``dp_shard=world_size // R``. It changes no call; it
    records the replacements in ``__deprecated_keywords__`` for the list of old spellings.

    Args:
        **replacements: ``old="what to write instead"`` per old keyword.

    Returns:
        The decorator, which returns the function itself.
    """

    def decorate(func: F) -> F:
        declared = {**getattr(func, "__deprecated_keywords__", {}), **replacements}
        func.__deprecated_keywords__ = declared  # type: ignore[attr-defined]
        return func

    return decorate
