"""What the command line needs from an executor, found through entry points.

The core names no executor. Each executor declares, in ``pyproject.toml``, the functions the
command line calls when a command needs a framework:

- ``gradsync.export`` / ``gradsync.import``: one entry per checkpoint format (``dcp``,
  ``orbax``), the function that converts a gradsync checkpoint to it or from it, called as
  ``convert(src, dst, **keywords)``; the keywords it takes (and which of them it requires)
  are read from its signature, so the command line checks what ``--model`` returned against
  the function itself (a deprecated spelling it still takes is accepted, and warns).
- ``gradsync.calibrate``: one entry per framework (``torch``, ``jax``), the function that
  measures the machine's collectives for ``gradsync calibrate``, called as
  ``calibrate(world_size=, sizes=, repeats=, name=)`` and returning a ``MachineProfile``
  (``None`` on the ranks of a ``torchrun`` job other than rank 0).
- ``gradsync.model_readers``: one entry per framework, named by the framework's top-level
  module (``torch``, ``jax``), a function that returns ``(specs, tied names)`` for a model
  of its framework and ``None`` for anything else. Only frameworks the user's function
  already imported are asked (whatever it built belongs to one of them), so reading a torch
  model never imports JAX.

An entry whose executor does not import (its framework is not installed) is one sentence
that names the extra to install.
"""

from __future__ import annotations

import importlib
import inspect
import sys
from collections.abc import Callable, Iterator
from importlib.metadata import EntryPoint, entry_points
from typing import Any

# What each checkpoint format needs installed: the modules its converter imports on use, in
# words, and the extra that installs them.
FORMATS = {
    "dcp": ((), "torch", "torch"),
    "orbax": (("orbax.checkpoint",), "JAX and orbax-checkpoint", "orbax"),
}


def _entry(group: str, name: str) -> EntryPoint:
    found = entry_points(group=group, name=name)
    if not found:
        raise ValueError(
            f"no {group} entry point named {name!r}: gradsync is not installed in this "
            'environment (pip install -e ".[all]" from a checkout, or pip install gradsync)'
        )
    return next(iter(found))


def converter(fmt: str, direction: str) -> Callable[..., None]:
    """The executor's ``export`` or ``import`` function for checkpoint format ``fmt``.

    Raises:
        ValueError: the format's framework does not import (with the extra to install).
    """
    modules, needs, extra = FORMATS[fmt]
    entry = _entry(f"gradsync.{direction}", fmt)
    try:
        for module in modules:
            importlib.import_module(module)
        function: Callable[..., None] = entry.load()
        return function
    except ImportError as err:
        raise ValueError(
            f"{fmt} interchange needs {needs}, and importing it failed ({err}); "
            f'install it with pip install "gradsync[{extra}]"'
        ) from None


# What each framework's calibration imports, in words, and the extra that installs it.
CALIBRATORS = {"torch": ("torch", "torch"), "jax": ("JAX", "jax")}


def calibrator(framework: str) -> Callable[..., Any]:
    """The executor's ``gradsync calibrate`` function for ``framework``.

    Raises:
        ValueError: the framework's executor does not import (with the extra to install).
    """
    needs, extra = CALIBRATORS[framework]
    entry = _entry("gradsync.calibrate", framework)
    try:
        function: Callable[..., Any] = entry.load()
        return function
    except ImportError as err:
        raise ValueError(
            f"calibrating with {framework} needs {needs}, and importing it failed ({err}); "
            f'install it with pip install "gradsync[{extra}]"'
        ) from None


def keywords(convert: Callable[..., None]) -> tuple[set[str], set[str], dict[str, str]]:
    """The keyword arguments ``convert`` takes after ``src`` and ``dst``, those it requires
    (no default), and its deprecated spellings, old to new (``gradsync_core.deprecation``'s
    ``renamed_keywords``: ``convert`` takes them too, with a warning)."""
    params = list(inspect.signature(convert).parameters.values())[2:]
    renamed: dict[str, str] = dict(getattr(convert, "__renamed_keywords__", {}))
    return (
        {p.name for p in params},
        {p.name for p in params if p.default is p.empty},
        renamed,
    )


def model_readers() -> Iterator[tuple[str, Callable[[Any], Any]]]:
    """``(framework, reader)`` for each framework already imported in this process."""
    for entry in entry_points(group="gradsync.model_readers"):
        if entry.name in sys.modules:
            yield entry.name, entry.load()
