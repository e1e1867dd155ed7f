"""``gradsync checkpoint export --to dcp|orbax`` and ``import --from dcp|orbax``.

The conversion itself is an executor's (torch's ``export_dcp`` / ``import_dcp``, JAX's
``export_orbax`` / ``import_orbax``); this module only parses the command and loads that
executor's function when the command runs, through its entry point (``_plugins``), so
``gradsync_core`` stays standard library only, names no executor, and a missing framework is
one sentence, not a traceback.

A gradsync checkpoint is named by parameter, not shaped as a program's tree: DCP also wants a
tied weight under each of its names and the optimizer class, Orbax the Flax tree and the
Optax chain. ``--model MODULE:FUNCTION`` names a function, taking no arguments, that builds
them and returns the keyword arguments of the executor's function (``{"model": net,
"optimizer": opt}`` for DCP, a torch optimizer; ``{"params": ..., "tx": ..., "model": ...,
"modules": ...}`` for Orbax, an Optax transformation, the last two optional).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from gradsync_core.cli._plugins import FORMATS, converter, keywords


def _factory(spec: str) -> Callable[[], Any]:
    """The function ``MODULE:FUNCTION`` names; MODULE is a dotted module found from the
    current directory or the Python path, or a ``.py`` file."""
    module_name, sep, attr = spec.rpartition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--model {spec!r} is not MODULE:FUNCTION; e.g. --model mymodel:build")
    if module_name.endswith(".py"):
        if not os.path.isfile(module_name):
            raise ValueError(f"--model file {module_name!r} does not exist")
        loader = importlib.util.spec_from_file_location("_gradsync_model", module_name)
        assert loader is not None and loader.loader is not None
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        if os.getcwd() not in sys.path:  # as ``python -m`` does: the user's own modules
            sys.path.insert(0, os.getcwd())
        module = importlib.import_module(module_name)
    function = getattr(module, attr, None)
    if not callable(function):
        raise ValueError(f"--model {spec!r}: {module_name} has no function {attr!r}")
    factory: Callable[[], Any] = function
    return factory


def _keywords(fmt: str, convert: Callable[..., None], spec: str) -> dict[str, Any]:
    """Call the ``--model`` function and check it returned what ``convert`` takes."""
    takes, required, renamed = keywords(convert)
    built = _factory(spec)()
    if not isinstance(built, Mapping):
        raise ValueError(
            f"--model {spec!r} returned {type(built).__name__}; return a dict with the keys "
            f"{sorted(takes)} ({', '.join(sorted(required))} required)"
        )
    # An old key (orbax's "optimizer" for "tx") is still taken: convert warns and renames it.
    given = {renamed.get(key, key) for key in built}
    unknown, missing = given - takes, required - given
    if unknown or missing:
        raise ValueError(
            f"--model {spec!r} returned the keys {sorted(built)}; {fmt} takes "
            f"{sorted(takes)} with {', '.join(sorted(required))} required"
        )
    return dict(built)


def _export(args: argparse.Namespace) -> int:
    convert = converter(args.to, "export")
    convert(args.src, args.dst, **_keywords(args.to, convert, args.model))
    print(f"exported gradsync checkpoint {args.src} to {args.to} checkpoint {args.dst}")
    return 0


def _import(args: argparse.Namespace) -> int:
    convert = converter(args.source, "import")
    convert(args.src, args.dst, **_keywords(args.source, convert, args.model))
    print(f"imported {args.source} checkpoint {args.src} as gradsync checkpoint {args.dst}")
    return 0


_MODEL_HELP = (
    "a function taking no arguments that builds the model and optimizer and returns the "
    "keyword arguments of the conversion: {'model': net, 'optimizer': opt} for dcp; "
    "{'params': tree, 'tx': optax_tx, 'model': weights_tree, 'modules': renames} for "
    "orbax (model and modules optional). MODULE is a module on the Python path or in the "
    "current directory, or a .py file"
)


def add_interchange_parsers(actions: Any) -> None:
    """The ``export`` and ``import`` actions of ``gradsync checkpoint``."""
    export = actions.add_parser(
        "export",
        help="write a gradsync checkpoint as a torch DCP or an Orbax checkpoint",
        description="Write the gradsync checkpoint SRC (either framework's, any world size) "
        "as a DCP checkpoint of {'model', 'optim'} state dicts or an Orbax checkpoint of "
        "{'params', 'opt_state'} at DST (docs/interchange.md). Exit 2 on bad input.",
    )
    export.add_argument("--to", choices=sorted(FORMATS), required=True, help="the format")
    imp = actions.add_parser(
        "import",
        help="write a torch DCP or an Orbax checkpoint as a gradsync checkpoint",
        description="Write the DCP or Orbax checkpoint SRC (as export writes it) as a "
        "gradsync checkpoint with model weights at DST, which gradsync_torch and gradsync_jax "
        "load at any world size (docs/interchange.md). Exit 2 on bad input.",
    )
    imp.add_argument(
        "--from", dest="source", choices=sorted(FORMATS), required=True, help="the format"
    )
    for parser, run in ((export, _export), (imp, _import)):
        parser.add_argument("src", metavar="SRC", help="the checkpoint to read")
        parser.add_argument("dst", metavar="DST", help="the checkpoint to write")
        parser.add_argument("--model", metavar="MODULE:FUNCTION", required=True, help=_MODEL_HELP)
        parser.set_defaults(run=run)
