"""Options given as one record or as keywords, never both (docs/design.md §13).

A function with many options takes them either way: its keywords one by one, as the framework
it mirrors spells them (``DataParallel(module, bucket_cap_mb=50)``, DDP's), or the record that
holds them (``DataParallel(module, options=DataParallelOptions(bucket_cap_mb=50))``), which a
program builds once, compares, logs and passes on (torchtitan's ``parallelize_llama(model, *,
parallel_dims, ...)``). Both at once would leave one of the two ignored, so a call that gives
the record and any of its fields is refused with one sentence. The keywords keep their real
defaults in the signature: ``takes_options`` tells a keyword given from one left out by the
call itself.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def takes_options(record: type, *, parameter: str = "options") -> Callable[[F], F]:
    """Decorator: refuse a call that passes ``parameter`` (the record) with any of
    ``record``'s fields as keywords. The function builds the record from its keywords when
    ``parameter`` is ``None``.

    Args:
        record: a dataclass whose field names are keyword parameters of the function.
        parameter: the function's parameter that takes the record.

    Returns:
        The decorator.

    Raises:
        TypeError: (from the decorated function) the record and some of its fields given.

    Example:
        >>> @dataclasses.dataclass(frozen=True)
        ... class Options:
        ...     overlap: bool = True
        >>> @takes_options(Options)
        ... def wrap(*, options=None, overlap=True):
        ...     return options or Options(overlap=overlap)
        >>> wrap(overlap=False)
        Options(overlap=False)
        >>> wrap(options=Options(), overlap=False)
        Traceback (most recent call last):
        TypeError: wrap() got options= and overlap=, which it also holds; pass the options in \
one place: the keywords alone, or options=dataclasses.replace(options, overlap=...)
    """
    fields = {field.name for field in dataclasses.fields(record)}

    def decorate(func: F) -> F:
        signature = inspect.signature(func)
        where = func.__qualname__.rpartition("<locals>.")[2].removesuffix(".__init__")
        missing = fields - signature.parameters.keys()
        if missing:  # a field the keywords cannot give: the two forms would differ
            raise TypeError(f"{where} lacks keywords for {sorted(missing)} of {record.__name__}")

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            given = signature.bind_partial(*args, **kwargs).arguments
            both = sorted(fields & given.keys()) if given.get(parameter) is not None else []
            if both:
                named = ", ".join(f"{name}=" for name in both)
                raise TypeError(
                    f"{where}() got {parameter}= and {named}, which it also holds; pass the "
                    f"options in one place: the keywords alone, or "
                    f"{parameter}=dataclasses.replace({parameter}, {both[0]}=...)"
                )
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
